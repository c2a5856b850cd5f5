"""Tool-call parsers, chosen by name (`GatewayConfig.tool_parser`).

A parser turns a completion's text, fed as it streams, into `Content`,
`Reasoning` and `ToolCall` events. One file per model family; add a family by
adding a file and a line to `PARSERS`.
"""

from __future__ import annotations

from undertow.gateway.toolparsers.base import Content, Event, Reasoning, ToolCall, ToolParser
from undertow.gateway.toolparsers.hermes import HermesParser

__all__ = ["PARSERS", "Content", "Event", "Reasoning", "ToolCall", "ToolParser", "create_parser"]

# The built-in model writes Qwen/Hermes-style `<tool_call>{json}</tool_call>` blocks.
PARSERS: dict[str, type[ToolParser]] = {
    "undertow": HermesParser,
    "hermes": HermesParser,
    "qwen": HermesParser,
}


def create_parser(name: str, parse_tools: bool = True) -> ToolParser:
    """A fresh parser for one completion; `parse_tools=False` leaves tool calls as text."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {sorted(PARSERS)}")
    return PARSERS[name](parse_tools=parse_tools)
