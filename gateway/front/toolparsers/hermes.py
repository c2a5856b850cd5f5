"""Hermes JSON tool calls (Qwen2.5, Qwen3, the built-in model), with `<think>` reasoning:

    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>

(several joined by a newline), as Qwen2.5's and Qwen3's templates write them; a forced
call is written the same way, as SGLang's `qwen25` detector and xgrammar's `qwen_3` tag do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import ToolCall, call_tag, calls_format, name_json
from undertow.gateway.front.toolparsers.tagged import TaggedParser


def parse_call(block: str) -> ToolCall | None:
    """A `{"name": ..., "arguments"|"parameters": {...}}` object as a tool call."""
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


class HermesParser(TaggedParser):
    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        tags = [call_tag(f'<tool_call>\n{{"name": {name_json(tool)}, "arguments": ', tool,
                         "}\n</tool_call>") for tool in tools]
        return calls_format(tags, "\n", parallel)

    def read_block(self, block: str) -> list[ToolCall] | None:
        call = parse_call(block.strip())
        return [call] if call else None
