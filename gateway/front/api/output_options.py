"""What a request asks of the output and of the template, read from each API's own fields
before its `CallRequest` is built: forced tool use and JSON output (both by the engine's
constrained decoding) and one tool call at most, gathered in an `OutputConstraint` that
builds the call's `SamplingParams`; template arguments. A value the gateway cannot honour is
a 400 naming it. Each field: docs/api.md, "Request fields".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from undertow.gateway.engines.protocol import SamplingParams
from undertow.gateway.errors import BadRequest, UnsupportedParameter
from undertow.gateway.front.toolparsers import PARSERS, forced_structural_tag

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
RESERVED_KWARGS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def template_kwargs(kwargs: Any, reasoning_effort: Any = None,
                    kwargs_param: str = "chat_template_kwargs",
                    effort_param: str = "reasoning_effort") -> dict | None:
    """The template arguments of a request, validated; None when there are none."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest(f"{kwargs_param} must be an object", param=kwargs_param)
    result = dict(kwargs or {})
    reserved = sorted(RESERVED_KWARGS & set(result))
    if reserved:
        raise BadRequest(f"{kwargs_param} may not set {reserved[0]!r}: the gateway sets it",
                         param=kwargs_param)
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise BadRequest(f"{effort_param} must be one of {list(REASONING_EFFORTS)}, got "
                             f"{reasoning_effort!r}", param=effort_param)
        result["reasoning_effort"] = reasoning_effort
    return result or None


def template_variable(kwargs: dict | None, reads: Callable[[str], bool], name: str,
                      value: Any, param: str) -> dict | None:
    """`kwargs` with `name=value` for the template when it reads `name`; a 400 naming
    `param` when it does not (the value would change nothing: silence)."""
    if value is None:
        return kwargs
    if not isinstance(value, str):
        raise BadRequest(f"{param} must be a string, got {value!r}", param=param)
    if not reads(name):
        raise UnsupportedParameter(f"{param} cannot be honoured: this model's chat template "
                                   f"has no {name!r} argument; omit {param}", param=param)
    return {**(kwargs or {}), name: value}


def check_value(value: Any, allowed: tuple, param: str, why: str) -> None:
    """A field of which the gateway honours only the values `allowed` (absent is fine)."""
    if value is not None and value not in allowed:
        raise UnsupportedParameter(f"{param}={value!r} cannot be honoured: {why}; use one of "
                                   f"{list(allowed)} or omit it", param=param)


def known_keys(value: Any, known: set[str], param: str) -> dict:
    """An object field (absent: `{}`) whose sub-fields are all among `known`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    unknown = sorted(set(value) - known)
    if unknown:
        raise UnsupportedParameter(f"{param}.{unknown[0]} is not supported by this gateway; "
                                   f"omit it (supported: {sorted(known)})",
                                   param=f"{param}.{unknown[0]}")
    return value


def stream_options(value: Any, known: set[str]) -> dict:
    """`stream_options`: `include_usage` (where `known`) is honoured; the gateway never
    pads stream events, so `include_obfuscation` may only be false."""
    options = known_keys(value, known, "stream_options")
    check_value(options.get("include_obfuscation"), (False,),
                "stream_options.include_obfuscation",
                "the gateway does not pad stream events with obfuscation")
    return options


def tool_names(tools: list[dict] | None) -> list[str]:
    return [tool["function"].get("name") for tool in tools or ()]


@dataclass(frozen=True)
class OutputConstraint:
    """What a request's output options ask of its sampling, worked out before its
    `SamplingParams` are built (`sampling_params`, once): a forced call's structural tag
    or a JSON schema (at most one: both are the engine's constrained decoding), and the
    stop string that ends free tool use at its first call (`single_call_stop`)."""

    structural_tag: str | None = None
    json_schema: str | None = None
    stop: tuple[str, ...] = ()

    def sampling_params(self, fields: dict[str, Any]) -> SamplingParams:
        """The call's sampling parameters: the request's sampling `fields` (validated,
        by `SamplingParams`' names) under this constraint."""
        return SamplingParams(**{**fields, "stop": fields.get("stop", ()) + self.stop},
                              structural_tag=self.structural_tag, json_schema=self.json_schema)


def forced_tag(tools: list[dict] | None, name: str | None, parallel: bool, tool_parser: str,
               param: str = "tool_choice") -> str:
    """The structural tag of a call whose tool use is forced, in `tool_parser`'s format:
    to any of its `tools`, or only to `name`."""
    if not tools:
        raise BadRequest(f"{param} forces a tool call but the request has no tools",
                         param=param)
    if name is not None and name not in tool_names(tools):
        raise BadRequest(f"{param} names the function {name!r}, which is not among the "
                         f"tools {tool_names(tools)}", param=param)
    return forced_structural_tag(PARSERS[tool_parser], tools, name, parallel)


def check_strict(strict_params: list[str], free: bool) -> None:
    """Tools marked `strict` (arguments that must follow their schema): honoured when the
    call is forced, since the call list is then sampled under the tools' schemas, and moot
    when no call can be made (`tool_choice` none, or JSON output); free tool use (`free`:
    tool calls parsed, the output not constrained) cannot promise it, so a strict tool is
    then a 400 naming it."""
    if strict_params and free:
        raise UnsupportedParameter(
            f"{strict_params[0]}: strict arguments are honoured only for a forced call "
            "(tool_choice required or a named function, sampled under the schema); set "
            "strict to false or force the call", param=strict_params[0])


def single_call_stop(tools: list[dict] | None, tool_parser: str, constrained: bool
                     ) -> tuple[str, ...]:
    """The stop at the end of the first tool call (free tool use); none when there are no
    calls to limit (JSON output leaves no room for a call)."""
    stop = PARSERS[tool_parser].single_call_stop
    return () if not tools or not stop or constrained else (stop,)


def json_output(schema: Any, param: str, structural_tag: str | None = None) -> str:
    """The JSON schema (as JSON text) that the output must match: never with a forced call
    (`structural_tag`)."""
    if not isinstance(schema, dict):
        raise BadRequest(f"{param}: the JSON schema must be an object", param=param)
    if structural_tag is not None:
        raise BadRequest(f"{param}: a JSON output format cannot be combined with a forced "
                         "tool call", param=param)
    return json.dumps(schema)


def output_format(fmt: Any, param: str, structural_tag: str | None = None) -> str | None:
    """OpenAI's `response_format` (chat) or `text.format` (Responses): text (None),
    json_object, or json_schema (its schema under `json_schema.schema` in chat, `schema` in
    Responses), as `json_output`'s JSON schema."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_output({"type": "object"}, param, structural_tag)
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if "json_schema" in fmt else (
            fmt.get("schema"))
        return json_output(schema or {"type": "object"}, param, structural_tag)
    raise UnsupportedParameter(f"{param} type {kind!r} is not supported (text, json_object, "
                               "json_schema)", param=param)
