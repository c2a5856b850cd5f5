"""Forced tool use (`tool_choice` "required"/"any" or a named function), written in the
model's own tool-call syntax: the engine samples under a structural tag (xgrammar's format,
which SGLang, vLLM and the built-in engine take) of calls as the family writes them (each
parser's `forced_format`), arguments under the tools' schemas. So the gateway's parser reads
a forced call like a free one, and the history stays in the model's format: a call forced as
a bare JSON list taught the model that list, which it then wrote in free turns (issue 36).
SGLang 0.5.23 forces calls the same way (`FunctionCallParser.get_structure_constraint`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import Event, ToolCall, ToolParser, Unparsed

FORCED_TITLE = "undertow forced tool calls"
SEPARATORS = ("\n\n", "\n", "")  # what a model writes after its reasoning block


def forced_structural_tag(parser: type[ToolParser], tools: Sequence[dict], name: str | None,
                          parallel: bool = True) -> str:
    """The `structural_tag` sampling parameter (JSON text) of a forced call in `parser`'s
    format: to any of `tools`, or only to `name`; with `parallel=False`, exactly one."""
    chosen = [tool for tool in tools if name is None or tool["function"]["name"] == name]
    return json.dumps({"type": "structural_tag",
                       "format": parser.forced_format(chosen, parallel)}, ensure_ascii=False)


def reasoning_first(structural_tag: str | None, parser: ToolParser) -> str | None:
    """`structural_tag` (a forced call's, or None), its calls preceded by the end of the
    reasoning block when the completion begins inside one (`parser.open_reasoning_end`,
    from the prompt's tail: a template that opens it at the end of the generation prompt,
    as DeepSeek-R1's and GLM-4.7's do): the model reasons freely, closes the block, then
    writes the calls, as SGLang's reasoner grammar leaves the reasoning unconstrained."""
    end = parser.open_reasoning_end
    if structural_tag is None or not end:
        return structural_tag
    tag = json.loads(structural_tag)
    reasoning = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                 "end": [end + separator for separator in SEPARATORS]}
    tag["format"] = {"type": "sequence", "elements": [reasoning, tag["format"]]}
    return json.dumps(tag, ensure_ascii=False)


def is_forced(sampling: dict) -> bool:
    """Whether a call's recorded sampling parameters forced its tool calls as a JSON list
    (calls recorded before forced calls were written in the model's format)."""
    return FORCED_TITLE in (sampling.get("json_schema") or "")


class ForcedCallsParser:
    """Reads a completion recorded before forced calls took the model's syntax, forced
    as a JSON list `[{"name", "parameters"}]` under a schema titled `FORCED_TITLE`
    (`is_forced`, `toolparsers.replay_parser`)."""

    keeps_special_tokens = False
    single_call_stop = ""
    open_reasoning_end = ""

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = ""):
        self._buffer = ""

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
        raise ValueError("the 'forced' parser only reads calls recorded as JSON lists; "
                         "force calls with the gateway's tool parser")

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            return [Unparsed(text)] if text else []
        calls: list[Event] = [ToolCall(value["name"], value["parameters"]) for value in values
                 if isinstance(value, dict) and isinstance(value.get("name"), str)
                 and isinstance(value.get("parameters"), dict)] if isinstance(values, list) else []
        return calls if calls and len(calls) == len(values) else [Unparsed(text)]
