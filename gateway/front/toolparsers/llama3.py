"""Llama 3.x JSON tool calls: the whole assistant turn is one or more JSON objects

    {"name": NAME, "parameters": {...}}          (several are joined by ";")

optionally after `<|python_tag|>` (a special token, so usually decoded away). The
template sends tool results back in the `ipython` role. A turn that starts with `{`
is held until the end of the completion and then read as calls; if it is JSON but
not calls it is the answer (content), if it is not JSON it is an `Unparsed` call.
Other turns stream as content. Llama 3 has no reasoning block. A forced call is one object
as the template writes it (xgrammar's `llama` tag); Llama 3.1's template takes one call per
turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import (
    Content,
    Event,
    ToolCall,
    Unparsed,
    call_tag,
    calls_format,
    every_call,
    name_json,
)

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def read_objects(text: str) -> list | None:
    """The JSON values in `text`, separated by whitespace or `;`; None if it is not."""
    values, index = [], 0
    while True:
        while index < len(text) and text[index] in " \t\r\n;":
            index += 1
        if index == len(text):
            return values
        try:
            value, index = _DECODER.raw_decode(text, index)
        except json.JSONDecodeError:
            return None
        values.append(value)


def as_call(value) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("parameters", value.get("arguments", {}))
    return ToolCall(value["name"], arguments) if isinstance(arguments, dict) else None


class Llama3JsonParser:
    keeps_special_tokens = False
    single_call_stop = ""  # not enforced: Llama 3.x writes one call per turn
    open_reasoning_end = ""  # no reasoning block

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = ""):
        self._parse_tools = parse_tools
        self._state = "start" if parse_tools else "content"
        self._buffer = ""

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        tags = [call_tag(f'{{"name": {name_json(tool)}, "parameters": ', tool, "}")
                for tool in tools]
        return calls_format(tags, "; ", parallel=False)

    def feed(self, text: str) -> list[Event]:
        if self._state == "content":
            return [Content(text)] if text else []
        self._buffer += text
        stripped = self._buffer.lstrip()
        if self._state == "start" and stripped:
            starts_call = stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped)
            if not starts_call:
                self._state = "content"
                text, self._buffer = self._buffer, ""
                return [Content(text)]
            if stripped.startswith(("{", PYTHON_TAG)):
                self._state = "call"
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        if self._state != "call":
            return [Content(text)]
        values = read_objects(text.strip().removeprefix(PYTHON_TAG))
        if values is None:
            return [Unparsed(text)]
        calls = every_call([as_call(value) for value in values])
        return [*calls] if calls is not None else [Content(text)]
