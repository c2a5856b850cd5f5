"""Tool-call and reasoning parsers, chosen by name (`GatewayConfig.tool_parser`,
`gateway serve tool_parser=NAME`), or `auto`: detected from the model directory's chat template
(`detect.py`).

A parser turns a completion's text, fed as it streams, into `Content`, `Reasoning`
and `ToolCall` events (and `Unparsed`: content that was a tool call it could not
read). One file per format; add a format by adding a file and a line to `PARSERS`.
Reasoning is parsed by the same parser: a leading `<think>` block (Qwen3,
DeepSeek-R1, GLM-4.5) or harmony's analysis channel (gpt-oss).
"""

from __future__ import annotations

from collections.abc import Sequence

from undertow.gateway.front.toolparsers.base import (
    Content,
    Event,
    Reasoning,
    ToolCall,
    ToolParser,
    Unparsed,
)
from undertow.gateway.front.toolparsers.deepseek import DeepSeekParser
from undertow.gateway.front.toolparsers.detect import parser_of_template, resolve_parser
from undertow.gateway.front.toolparsers.forced import (
    ForcedCallsParser,
    forced_structural_tag,
    is_forced,
    reasoning_first,
)
from undertow.gateway.front.toolparsers.glm45 import Glm45Parser
from undertow.gateway.front.toolparsers.harmony import HarmonyParser
from undertow.gateway.front.toolparsers.hermes import HermesParser
from undertow.gateway.front.toolparsers.kimi_k2 import KimiK2Parser
from undertow.gateway.front.toolparsers.llama3 import Llama3JsonParser
from undertow.gateway.front.toolparsers.qwen3_coder import Qwen3CoderParser

__all__ = ["FORCED", "PARSERS", "Content", "Event", "Reasoning", "ToolCall", "ToolParser",
           "Unparsed", "create_parser", "forced_structural_tag", "parser_of_template",
           "reasoning_first", "replay_parser", "resolve_parser"]

FORCED = "forced"

# The built-in model writes Qwen/Hermes-style `<tool_call>{json}</tool_call>` blocks.
PARSERS: dict[str, type[ToolParser]] = {
    "undertow": HermesParser,
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser,
    "deepseek_v3": DeepSeekParser,
    "deepseek_r1": DeepSeekParser,
    "glm45": Glm45Parser,
    "harmony": HarmonyParser,
    "gpt_oss": HarmonyParser,
    "kimi_k2": KimiK2Parser,
    FORCED: ForcedCallsParser,  # reads calls recorded forced as JSON lists (`forced.py`)
}


def replay_parser(tool_parser: str, call_record: dict) -> str:
    """The parser a recorded call's completion was parsed with: `forced` when its
    sampling parameters forced tool calls as a JSON list (calls recorded before forced
    calls were written in the model's own format), else the gateway's."""
    sampling = (call_record.get("meta") or {}).get("sampling") or {}
    return FORCED if is_forced(sampling) else tool_parser


def create_parser(name: str, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                  prompt_tail: str = "") -> ToolParser:
    """A fresh parser for one completion; `parse_tools=False` leaves tool calls as text.
    `tools` and `prompt_tail`: see `ToolParser`."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; choose one of {sorted(PARSERS)} "
                         "or 'auto'")
    return PARSERS[name](parse_tools=parse_tools, tools=tools, prompt_tail=prompt_tail)
