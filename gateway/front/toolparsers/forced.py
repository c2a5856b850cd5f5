"""The output of a call whose tool use is forced (`tool_choice` "required" or a named
function): the engine's constrained decoding makes the model write exactly

    [{"name": NAME, "parameters": {...}}, ...]

(the schema is `forced_calls_schema`), whatever the family's own format, as vLLM
and SGLang do for forced tool choice. The list is read at the end of the completion;
a list cut short (`max_tokens`) is `Unparsed`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from undertow.gateway.front.toolparsers.base import Event, ToolCall, Unparsed

FORCED_TITLE = "undertow forced tool calls"


def is_forced(sampling: dict) -> bool:
    """Whether a call's recorded sampling parameters forced its tool calls."""
    return FORCED_TITLE in (sampling.get("json_schema") or "")


def forced_calls_schema(tools: Sequence[dict], name: str | None,
                        parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a forced list of calls: to any of `tools`, or only to `name`;
    with `parallel=False`, exactly one call."""
    items = []
    for tool in tools:
        function = tool["function"]
        if name is None or function["name"] == name:
            items.append({"type": "object", "additionalProperties": False,
                          "required": ["name", "parameters"],
                          "properties": {"name": {"const": function["name"]},
                                         "parameters": function.get("parameters")
                                         or {"type": "object"}}})
    schema: dict[str, Any] = {"title": FORCED_TITLE, "type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ForcedCallsParser:
    keeps_special_tokens = False
    single_call_stop = ""  # the schema limits forced calls (maxItems)

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = ""):
        self._buffer = ""

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
