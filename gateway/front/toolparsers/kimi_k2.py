"""Kimi-K2's tool calls: one section of calls in its own special tokens, each call's ID
(`functions.NAME:INDEX`) then its JSON arguments:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|>...<|tool_calls_section_end|>

The markers are special tokens, so the completion is decoded with them
(`keeps_special_tokens`); the turn's end token `<|im_end|>` that then shows is no content.
A forced call is written the same way (as xgrammar's `kimi` tag, which SGLang uses).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import (
    Event,
    ToolCall,
    arguments_format,
    calls_format,
    every_call,
    partial_tag_length,
)
from undertow.gateway.front.toolparsers.tagged import TaggedParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([^\s<:]+)(?::\d+)?\s*"
                  r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)", re.S)
TURN_END = "<|im_end|>"


def read_call(name: str, arguments: str) -> ToolCall | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return ToolCall(name, value) if isinstance(value, dict) else None


class KimiK2Parser(TaggedParser):
    CALL_OPEN, CALL_CLOSE = SECTION_BEGIN, SECTION_END
    keeps_special_tokens = True
    single_call_stop = "<|tool_call_end|>"

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        tags = [{"type": "tag", "end": "<|tool_call_end|>",
                 "begin": f"<|tool_call_begin|>functions.{tool['function']['name']}:",
                 "content": {"type": "sequence", "elements": [  # the call's index, arguments
                     {"type": "regex", "pattern": r"\d+"},
                     {"type": "const_string", "value": "<|tool_call_argument_begin|>"},
                     arguments_format(tool)]}} for tool in tools]
        return {"type": "tag", "begin": SECTION_BEGIN, "end": SECTION_END,
                "content": calls_format(tags, "", parallel)}

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = ""):
        super().__init__(parse_tools, tools=tools, prompt_tail=prompt_tail)
        self._held = ""  # what may be the start of the turn end, until the next text

    def feed(self, text: str) -> list[Event]:
        text = (self._held + text).replace(TURN_END, "")
        keep = partial_tag_length(text, TURN_END)
        self._held = text[len(text) - keep:] if keep else ""
        ready = text[:len(text) - keep]
        return super().feed(ready) if ready else []  # no text: the state stays

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        return (super().feed(held) if held else []) + super().finish()

    def read_block(self, block: str) -> list[ToolCall] | None:
        calls = every_call([read_call(name, arguments) for name, arguments in CALL.findall(block)])
        if calls is None or CALL.sub("", block).strip():
            return None
        return calls
