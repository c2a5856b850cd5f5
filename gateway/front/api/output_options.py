"""What a request asks of the output and of the template, read from each API's own fields
into a `CallRequest`: forced tool use and JSON output (both by the engine's constrained
decoding), one tool call at most, template arguments; a value the gateway cannot honour is a
400 naming it. Each field: docs/api.md, "Request fields".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from undertow.gateway.errors import BadRequest, UnsupportedParameter
from undertow.gateway.front.calls import CallRequest
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


def force_tools(call: CallRequest, name: str | None, parallel: bool, tool_parser: str,
                param: str = "tool_choice") -> CallRequest:
    """The call with its tool use forced, in `tool_parser`'s format: to any of its tools,
    or only to `name`."""
    if not call.tools:
        raise BadRequest(f"{param} forces a tool call but the request has no tools",
                         param=param)
    if name is not None and name not in tool_names(call.tools):
        raise BadRequest(f"{param} names the function {name!r}, which is not among the "
                         f"tools {tool_names(call.tools)}", param=param)
    tag = forced_structural_tag(PARSERS[tool_parser], call.tools, name, parallel)
    return replace(call, sampling=replace(call.sampling, structural_tag=tag))


def check_strict(call: CallRequest, strict_params: list[str]) -> None:
    """Tools marked `strict` (arguments that must follow their schema): honoured when the
    call is forced, since the call list is then sampled under the tools' schemas, and moot
    when no call can be made (`tool_choice` none, or JSON output); free tool use cannot
    promise it, so a strict tool is then a 400 naming it."""
    free = call.parse_tools and not call.sampling.constrained
    if strict_params and free:
        raise UnsupportedParameter(
            f"{strict_params[0]}: strict arguments are honoured only for a forced call "
            "(tool_choice required or a named function, sampled under the schema); set "
            "strict to false or force the call", param=strict_params[0])


def single_call(call: CallRequest, tool_parser: str) -> CallRequest:
    """The call, stopped at the end of its first tool call (free tool use)."""
    stop = PARSERS[tool_parser].single_call_stop
    if not call.tools or not stop or call.sampling.constrained:
        return call  # no calls to limit (JSON output leaves no room for a call)
    return replace(call, sampling=replace(call.sampling, stop=call.sampling.stop + (stop,)))


def json_output(call: CallRequest, schema: Any, param: str) -> CallRequest:
    """The call with its output constrained to JSON matching `schema`."""
    if not isinstance(schema, dict):
        raise BadRequest(f"{param}: the JSON schema must be an object", param=param)
    if call.sampling.structural_tag is not None:
        raise BadRequest(f"{param}: a JSON output format cannot be combined with a forced "
                         "tool call", param=param)
    sampling = replace(call.sampling, json_schema=json.dumps(schema))
    return replace(call, sampling=sampling)


def output_format(call: CallRequest, fmt: Any, param: str) -> CallRequest:
    """OpenAI's `response_format` (chat) or `text.format` (Responses): text, json_object,
    or json_schema (its schema under `json_schema.schema` in chat, `schema` in Responses)."""
    if fmt is None:
        return call
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind == "text":
        return call
    if kind == "json_object":
        return json_output(call, {"type": "object"}, param)
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if "json_schema" in fmt else (
            fmt.get("schema"))
        return json_output(call, schema or {"type": "object"}, param)
    raise UnsupportedParameter(f"{param} type {kind!r} is not supported (text, json_object, "
                               "json_schema)", param=param)
