"""Hermes JSON tool calls (Qwen2.5, Qwen3, the built-in model), with `<think>` reasoning:

    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
"""

from __future__ import annotations

import json

from undertow.gateway.front.toolparsers.base import ToolCall
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
    def read_block(self, block: str) -> list[ToolCall] | None:
        call = parse_call(block.strip())
        return [call] if call else None
