"""The parser shared by formats that wrap each tool call (or the list of them) in an opening
and a closing tag, with reasoning in an optional leading `<think>` block:

    <think>\\n{reasoning}\\n</think>\\n\\n{content}\\n{CALL_OPEN}{block}{CALL_CLOSE}...

A format is a subclass naming its tags and reading one block into tool calls (`read_block`):
Hermes, Qwen3-Coder, GLM-4.5 and DeepSeek-V3/R1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import (
    Content,
    Event,
    Reasoning,
    ToolCall,
    Unparsed,
    partial_tag_length,
)


class TaggedParser:
    """States: `start` (may open a think block), `think`, `content`, `call`. Text is
    emitted as soon as it cannot be the start of a tag; a tool call whole when its closing
    tag arrives (each SDK gets its name and full arguments in one delta), or at the end
    if the model stopped inside it. Whitespace right before a call is dropped (templates
    write it as a separator); a block that cannot be read stays content (`Unparsed`).
    When the prompt opened the think block (DeepSeek-R1's and Qwen3's thinking templates
    end the generation prompt with `<think>\\n`), the completion starts inside it."""

    THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
    CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
    keeps_special_tokens = False
    single_call_stop = "</tool_call>"

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = ""):
        self._parse_tools = parse_tools
        self.tools = tools
        self._state = "start"
        self._buffer = ""
        self._pending_space = ""
        self._num_calls = 0
        self._lstrip = False
        self.open_reasoning_end = ""
        if prompt_tail.rstrip().endswith(self.THINK_OPEN):
            self._state, self._lstrip = "think", True
            self.open_reasoning_end = self.THINK_CLOSE

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        """See `ToolParser`; each format writes its own."""
        raise NotImplementedError

    def read_block(self, block: str) -> list[ToolCall] | None:
        """The tool calls written between the tags, or None if the block is not one."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while getattr(self, f"_step_{self._state}")(events):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._state == "think":
            events.append(Reasoning(self._buffer.rstrip("\n")))
        elif self._state == "call":
            calls = self.read_block(self._buffer)
            events += calls if calls else [Unparsed(self.CALL_OPEN + self._buffer)]
        else:
            text = self._pending_space + self._buffer
            events.append(Content(text.rstrip() if self._num_calls else text))
        self._buffer, self._pending_space = "", ""
        return [event for event in events if not isinstance(event, Content | Reasoning)
                or event.text]

    def _step_start(self, events: list[Event]) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.THINK_OPEN):
            self._buffer = stripped[len(self.THINK_OPEN):]
            self._state, self._lstrip = "think", True
            return True
        if self.THINK_OPEN.startswith(stripped) and stripped:
            return False
        if not stripped and self._buffer:
            return False
        self._state = "content"
        return True

    def _strip_leading_newlines(self) -> bool:
        """After a think tag, newlines are the template's separators, not text."""
        if self._lstrip:
            self._buffer = self._buffer.lstrip("\n")
            self._lstrip = not self._buffer
        return not self._lstrip

    def _step_think(self, events: list[Event]) -> bool:
        if not self._strip_leading_newlines():
            return False
        index = self._buffer.find(self.THINK_CLOSE)
        if index < 0:
            keep = partial_tag_length(self._buffer, self.THINK_CLOSE)
            emit = self._buffer[:len(self._buffer) - keep].rstrip("\n")
            if emit:
                events.append(Reasoning(emit))
            self._buffer = self._buffer[len(emit):]
            return False
        reasoning = self._buffer[:index].rstrip("\n")
        if reasoning:
            events.append(Reasoning(reasoning))
        self._buffer = self._buffer[index + len(self.THINK_CLOSE):]
        self._state, self._lstrip = "content", True
        return True

    def _step_content(self, events: list[Event]) -> bool:
        if not self._strip_leading_newlines():
            return False
        index = self._buffer.find(self.CALL_OPEN) if self._parse_tools else -1
        if index < 0:
            keep = partial_tag_length(self._buffer, self.CALL_OPEN) if self._parse_tools else 0
            self._emit_content(self._buffer[:len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._emit_content(self._buffer[:index], events)
        self._pending_space = ""
        self._buffer = self._buffer[index + len(self.CALL_OPEN):]
        self._state = "call"
        return True

    def _step_call(self, events: list[Event]) -> bool:
        index = self._buffer.find(self.CALL_CLOSE)
        if index < 0:
            return False
        block = self._buffer[:index]
        calls = self.read_block(block)
        events += calls if calls else [Unparsed(self.CALL_OPEN + block + self.CALL_CLOSE)]
        self._num_calls += len(calls or ())
        self._buffer = self._buffer[index + len(self.CALL_CLOSE):]
        self._state = "content"
        return True

    def _emit_content(self, text: str, events: list[Event]) -> None:
        """Emits content, holding back trailing whitespace (it may precede a tool call)."""
        text = self._pending_space + text
        stripped = text.rstrip()
        self._pending_space = text[len(stripped):]
        if stripped:
            events.append(Content(stripped))
