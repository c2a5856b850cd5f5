"""gpt-oss's harmony format: messages on channels, written with special tokens.

    <|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
    {args}<|call|>      (one line; the arguments follow <|message|> directly)
    <|start|>assistant<|channel|>final<|message|>{content}<|return|>

(The generation prompt ends with `<|start|>assistant`.) The `analysis` channel is
reasoning; a message to `functions.NAME` is a tool call (its JSON arguments read at
its `<|call|>`, or at the end of the completion); any other message (`final`, a
`commentary` preamble) is content. The recipient may also stand before the channel.
The markers are special tokens, so the completion is decoded with them
(`keeps_special_tokens`). Reasoning and content stream as they come. A forced call is the
one message to the function, as the template writes it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import (
    Content,
    Event,
    Reasoning,
    ToolCall,
    Unparsed,
    call_tag,
    calls_format,
    partial_tag_length,
)

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|endoftext|>", START)
MARKERS_ONLY = re.compile(r"(?:\s*<\|[a-z_]+\|>)*\s*")
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


def read_header(header: str) -> tuple[str, str | None]:
    """The channel and the recipient of a message's header."""
    channel = CHANNEL_NAME.search(header)
    recipient = RECIPIENT.search(header)
    return (channel.group(1) if channel else "", recipient.group(1) if recipient else None)


class HarmonyParser:
    """States: `header` (up to `<|message|>`), `message`, `call`."""

    keeps_special_tokens = True
    single_call_stop = ""  # `<|call|>` ends the turn: one call per completion
    open_reasoning_end = ""  # the analysis channel is a message of its own

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = ""):
        self._parse_tools = parse_tools
        self._state = "header"
        self._buffer = ""
        self._header = ""
        self._channel = ""

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        return calls_format([call_tag(f"{CHANNEL}commentary to=functions."
                                      f"{tool['function']['name']} <|constrain|>json{MESSAGE}",
                                      tool, "<|call|>") for tool in tools], "", parallel=False)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if self._state == "call":
            return [self._call(text, "")]
        if self._state == "message":
            return [self._message(text)] if text else []
        # A completion with no harmony markup at all: its text is the content. Special
        # tokens alone after the last message (an end-of-text token) are no text.
        text = self._header + text
        return [] if MARKERS_ONLY.fullmatch(text) else [Content(text)]

    def _step(self, events: list[Event]) -> bool:
        if self._state == "header":
            index = self._buffer.find(MESSAGE)
            if index < 0:
                return False
            self._header = self._buffer[:index]
            self._buffer = self._buffer[index + len(MESSAGE):]
            self._channel, recipient = read_header(self._header)
            calls = self._parse_tools and (recipient or "").startswith("functions.")
            self._state = "call" if calls else "message"
            return True
        found = [(self._buffer.find(tag), tag) for tag in ENDS if tag in self._buffer]
        if not found:
            if self._state == "message":
                keep = max(partial_tag_length(self._buffer, tag) for tag in ENDS)
                text = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(text):]
                if text:
                    events.append(self._message(text))
            return False
        index, tag = min(found)
        body, self._buffer = self._buffer[:index], self._buffer[index + len(tag):]
        if self._state == "call":
            events.append(self._call(body, tag))
        elif body:
            events.append(self._message(body))
        self._state, self._header = "header", ""
        return True

    def _message(self, text: str) -> Event:
        return Reasoning(text) if self._channel == "analysis" else Content(text)

    def _call(self, body: str, tag: str) -> Event:
        _, recipient = read_header(self._header)
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict) or recipient is None:  # (the `call` state has one)
            return Unparsed(self._header + MESSAGE + body + tag)
        return ToolCall(recipient.removeprefix("functions."), arguments)
