"""The protocol of tool-call parsers, the events they emit, and what the formats share.

A parser sees one completion's text as it streams. `Unparsed` is what a parser emits for
a tool call it could not read: it is `Content` (so every API returns it as text, and
nothing the model wrote is lost) that the call runner also counts in the metrics.

A format also says how a forced call is written (`forced_format`): a structural tag's
format (xgrammar's, which SGLang, vLLM and the built-in engine take) of one or more calls in
the model's own syntax, so that a forced call reads like a free one (`forced.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Unparsed(Content):
    """The text of a tool call the parser could not read, returned as content."""


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call; `arguments` is the parsed JSON object."""

    name: str
    arguments: Any

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Event = Content | Reasoning | ToolCall


class ToolParser(Protocol):
    """Stateful parser of one completion. `feed` takes new text and returns the events
    it completes; `finish` flushes at the end of the completion. Concatenating all
    Content texts gives the message's content, all Reasoning texts its reasoning.

    `tools` (the request's, OpenAI form) lets formats that write arguments as text
    convert them to the schema's types; `prompt_tail` is the end of the rendered prompt
    (a template that opens the think block itself, as DeepSeek-R1's does, leaves the
    completion inside it). `keeps_special_tokens`: the format's markers are special
    tokens, so the completion must be decoded with them (harmony). `single_call_stop`: the
    stop string that ends a completion after its first tool call ("" when the format
    writes one call per turn anyway).

    `open_reasoning_end`: the tag that ends the reasoning block the completion begins in
    (the prompt opened it), else "". `forced_format(tools, parallel)`: the structural tag
    format of a completion that is one or more calls (with `parallel=False`, exactly one) to
    any of `tools` (OpenAI form), written as the model writes them, arguments held to each
    tool's parameter schema."""

    keeps_special_tokens: bool
    single_call_stop: str
    open_reasoning_end: str

    def __init__(self, parse_tools: bool = True, *, tools: Sequence[dict] | None = None,
                 prompt_tail: str = "") -> None: ...

    @classmethod
    def forced_format(cls, tools: Sequence[dict], parallel: bool) -> dict[str, Any]: ...

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def every_call(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    """`calls` when there are some and each was read (not None), else None."""
    read = [call for call in calls if call is not None]
    return read if read and len(read) == len(calls) else None


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def parameter_schemas(tools: Sequence[dict] | None, name: str) -> dict[str, Any]:
    """The JSON schemas of the parameters of tool `name` (empty when unknown)."""
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def convert_value(text: str, schema: dict | None) -> Any:
    """An argument written as text (XML-style formats) as the type its schema names; a
    string when the schema says so, or when the text is not of the named type. Without
    a schema, JSON objects, arrays, numbers and booleans are read as such."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"  # models also write Python's True/False
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if kind is None:
        return value if not isinstance(value, str) else text
    wanted = {"integer": int, "number": (int, float), "boolean": bool, "object": dict,
              "array": list, "null": type(None)}.get(kind)
    if wanted is None or (isinstance(value, wanted) and not (
            kind in ("integer", "number") and isinstance(value, bool))):
        return value
    return text


def name_json(tool: dict) -> str:
    """A tool's name as a JSON string, as the templates' `tojson` writes it."""
    return json.dumps(tool["function"]["name"], ensure_ascii=False)


def arguments_format(tool: dict, style: str = "json") -> dict[str, Any]:
    """A structural tag's format of the arguments of `tool`, under its parameter schema (as
    JSON, or `style` the XML of Qwen3-Coder or GLM). At most one blank in a row between
    JSON's tokens: unbounded, a weak model may fill its budget with blanks."""
    schema = tool["function"].get("parameters") or {"type": "object"}
    return {"type": "json_schema", "json_schema": schema, "style": style,
            "max_whitespace_cnt": 1}


def call_tag(begin: str, tool: dict, end: str, style: str = "json") -> dict[str, Any]:
    """A structural tag's `tag`: `begin`, the arguments of `tool`, `end`."""
    return {"type": "tag", "begin": begin, "content": arguments_format(tool, style), "end": end}


def calls_format(tags: list[dict], separator: str, parallel: bool) -> dict[str, Any]:
    """One or more of `tags` joined by `separator` and nothing else (only one when not
    `parallel`)."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator,
            "at_least_one": True, "stop_after_first": not parallel}
