"""Qwen/Hermes-style completions, as the built-in model writes them:

    <think>\\n{reasoning}\\n</think>\\n\\n{content}\\n
    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>

Streaming: text is emitted as soon as it cannot be the start of a tag; a tool call
is emitted whole when its closing tag arrives (each SDK gets its name and full
arguments in one delta). Whitespace right before a tool call is dropped (the
template writes it as a separator). A block that is not valid JSON with a string
`name` stays content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json

from undertow.gateway.toolparsers.base import Content, Event, Reasoning, ToolCall

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def parse_call(block: str) -> ToolCall | None:
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(data["name"], arguments)


class HermesParser:
    """States: `start` (may open a think block), `think`, `content`, `call`."""

    def __init__(self, parse_tools: bool = True):
        self._parse_tools = parse_tools
        self._state = "start"
        self._buffer = ""
        self._pending_space = ""
        self._num_calls = 0
        self._lstrip = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            step = getattr(self, f"_step_{self._state}")(events)
            if not step:
                return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._state == "think":
            events.append(Reasoning(self._buffer.rstrip("\n")))
        elif self._state == "call":
            call = parse_call(self._buffer.strip())
            events.append(call if call else Content(CALL_OPEN + self._buffer))
        else:
            text = self._pending_space + self._buffer
            events.append(Content(text.rstrip() if self._num_calls else text))
        self._buffer, self._pending_space = "", ""
        return [event for event in events if not isinstance(event, Content | Reasoning)
                or event.text]

    def _step_start(self, events: list[Event]) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN):]
            self._state, self._lstrip = "think", True
            return True
        if THINK_OPEN.startswith(stripped) and stripped:
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
        index = self._buffer.find(THINK_CLOSE)
        if index < 0:
            rest = self._buffer[:len(self._buffer) - _partial_tag_length(self._buffer, THINK_CLOSE)]
            emit = rest.rstrip("\n")
            if emit:
                events.append(Reasoning(emit))
            self._buffer = self._buffer[len(emit):]
            return False
        reasoning = self._buffer[:index].rstrip("\n")
        if reasoning:
            events.append(Reasoning(reasoning))
        self._buffer = self._buffer[index + len(THINK_CLOSE):]
        self._state, self._lstrip = "content", True
        return True

    def _step_content(self, events: list[Event]) -> bool:
        if not self._strip_leading_newlines():
            return False
        index = self._buffer.find(CALL_OPEN) if self._parse_tools else -1
        if index < 0:
            keep = _partial_tag_length(self._buffer, CALL_OPEN) if self._parse_tools else 0
            self._emit_content(self._buffer[:len(self._buffer) - keep], events)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._emit_content(self._buffer[:index], events)
        self._pending_space = ""
        self._buffer = self._buffer[index + len(CALL_OPEN):]
        self._state = "call"
        return True

    def _step_call(self, events: list[Event]) -> bool:
        index = self._buffer.find(CALL_CLOSE)
        if index < 0:
            return False
        block = self._buffer[:index]
        call = parse_call(block.strip())
        events.append(call if call else Content(CALL_OPEN + block + CALL_CLOSE))
        self._num_calls += 1 if call else 0
        self._buffer = self._buffer[index + len(CALL_CLOSE):]
        self._state = "content"
        return True

    def _emit_content(self, text: str, events: list[Event]) -> None:
        """Emits content, holding back trailing whitespace (it may precede a tool call)."""
        text = self._pending_space + text
        stripped = text.rstrip()
        self._pending_space = text[len(stripped):]
        if stripped:
            events.append(Content(stripped))
