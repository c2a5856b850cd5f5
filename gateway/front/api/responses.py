"""`POST /v1/responses` (OpenAI Responses API, which Codex speaks), streaming and not.
Stateless: the scaffold sends its whole input each time; consecutive `reasoning`, assistant
`message` and `function_call` items become one assistant message. What each field becomes:
docs/api.md, "Request fields"; translated here, as in `anthropic_messages.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from undertow.gateway.errors import BadRequest, GatewayError, UnsupportedParameter
from undertow.gateway.front.api.common import (
    fingerprint,
    is_retry,
    read_json,
    reply_to_call,
    session_of,
    sse,
)
from undertow.gateway.front.api.errors import openai_error
from undertow.gateway.front.api.openai_chat import reads_nothing, sampling_fields
from undertow.gateway.front.api.output_options import (
    OutputConstraint,
    check_strict,
    check_value,
    forced_tag,
    known_keys,
    output_format,
    single_call_stop,
    stream_options,
    template_kwargs,
    template_variable,
)
from undertow.gateway.front.api.sealed_reasoning import seal, unseal
from undertow.gateway.front.calls import CallRequest, CallRunner, Delta, Outcome
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.toolparsers import Content, Reasoning, ToolCall

ACCEPTED = {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens",
            "temperature", "top_p", "stream", "store", "reasoning", "include",
            "parallel_tool_calls", "metadata", "text", "truncation", "user", "prompt_cache_key",
            "service_tier", "previous_response_id", "stream_options", "client_metadata"}
# Every accepted field, and how each is honoured (or why refused), is in the README's
# "Request fields" table. `user`, `metadata`, `client_metadata` and `prompt_cache_key`
# label a call for the provider and change no output; every call is recorded in the tree
# whatever `store` says.
SEALED = "reasoning.encrypted_content"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text", "summary_text",
                                    "reasoning_text"):
            raise UnsupportedParameter(f"{where}: part type {part.get('type')!r} is not "
                                       "supported (text only)", param="input")
        texts.append(part.get("text", ""))
    return "".join(texts)


def to_chat_messages(body: dict[str, Any]) -> list[dict]:
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a string or a non-empty list of items", param="input")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") != "assistant":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("system", "user"):
                raise BadRequest(f"{where}: unknown role {item.get('role')!r}", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _text(output, where)})
        elif kind in ("message", "reasoning", "function_call"):
            _add_to_assistant(messages, item, kind, where)
        else:
            raise UnsupportedParameter(f"{where}: item type {kind!r} is not supported",
                                       param="input")
    return messages


def _add_to_assistant(messages: list[dict], item: dict, kind: str, where: str) -> None:
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    message = messages[-1]
    if kind == "message":
        message["content"] += _text(item.get("content"), where)
    elif kind == "reasoning":
        text = (unseal(item["encrypted_content"], f"{where}.encrypted_content")
                if item.get("encrypted_content") else
                _text(item.get("summary") or [], where) or _text(item.get("content") or [], where))
        message["reasoning_content"] = message.get("reasoning_content", "") + text
    else:
        message.setdefault("tool_calls", []).append({
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}})


def to_chat_tools(tools: Any) -> list[dict] | None:
    result = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            raise BadRequest(f"tools: each tool must be an object, got {tool!r}", param="tools")
        # Tools that the API provider runs itself or that take free-form input (Codex sends
        # `web_search`, `custom` and `namespace` tools) have no function-call form for the
        # model: they are not offered to it, rather than failing the scaffold's request.
        if tool.get("type") != "function":
            continue
        result.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("parameters") or {}}})
    return result or None


def wants_sealed(body: dict[str, Any]) -> bool:
    """Whether reasoning items are to carry `encrypted_content` (`include`)."""
    return SEALED in (body.get("include") or ())


def wants_summary(body: dict[str, Any]) -> bool:
    """Whether reasoning items show their reasoning as a summary (unless `"none"`, as
    Codex sends with `model_reasoning_summary = "none"`)."""
    reasoning = body.get("reasoning") or {}
    return "none" not in (reasoning.get("summary"), reasoning.get("generate_summary"))


def check_request_options(body: dict[str, Any]) -> None:
    """The request-level fields that change nothing the model sees, where only some
    values can be honoured."""
    if body.get("previous_response_id"):
        raise UnsupportedParameter("previous_response_id is not supported: send the whole "
                                   "input with store=false", param="previous_response_id")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise BadRequest("include must be a list", param="include")
    for value in include:
        check_value(value, (SEALED,), "include", "the gateway runs no server-side tools and "
                    "returns no images or top logprobs")
    check_value(body.get("truncation"), ("disabled",), "truncation",
                "the gateway never drops input items (a prompt over the context is a 400)")
    check_value(body.get("service_tier"), ("auto", "default"), "service_tier",
                "the gateway has one service tier")
    stream_options(body.get("stream_options"), {"include_obfuscation"})


def parse_request(body: dict[str, Any], tool_parser: str = "hermes",
                  reads: Callable[[str], bool] = reads_nothing, *, fingerprint: str = "",
                  is_retry: bool = False) -> CallRequest:
    """The call a Responses request asks for, built once everything that shapes it is
    known; `reads` says which optional arguments the model's template takes
    (`Renderer.reads`); `fingerprint` and `is_retry` as `common.fingerprint` and
    `common.is_retry` give them."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise UnsupportedParameter(f"Unknown parameter: '{unknown[0]}'.", param=unknown[0])
    check_request_options(body)
    if not isinstance(body.get("model"), str):
        raise BadRequest("model must be a string", param="model")
    # The summary is the reasoning itself, whichever detail is asked for (or none).
    reasoning = known_keys(body.get("reasoning"), {"effort", "summary", "generate_summary"},
                           "reasoning")
    for name in ("summary", "generate_summary"):
        check_value(reasoning.get(name), ("auto", "concise", "detailed", "none"),
                    f"reasoning.{name}", "the summary is the reasoning itself")
    text = known_keys(body.get("text"), {"format", "verbosity"}, "text")
    kwargs = template_kwargs(None, reasoning.get("effort"), effort_param="reasoning.effort")
    sampling = sampling_fields(body, ("max_output_tokens",))
    messages = to_chat_messages(body)
    tools = to_chat_tools(body.get("tools"))
    template = template_variable(kwargs, reads, "verbosity", text.get("verbosity"),
                                 "text.verbosity")
    parse = body.get("tool_choice") != "none"
    output = output_constraint(body, tools, parse and bool(tools), tool_parser)
    return CallRequest(api="responses", model=body["model"],
                       sampling=output.sampling_params(sampling), messages=messages,
                       tools=tools, parse_tools=parse, fingerprint=fingerprint,
                       is_retry=is_retry, template_kwargs=template)


def output_constraint(body: dict[str, Any], tools: list[dict] | None, parses_tools: bool,
                      tool_parser: str) -> OutputConstraint:
    """`tool_choice`, `parallel_tool_calls` and `text.format` (see `output_options`)."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    tag = None
    if choice == "required" or isinstance(choice, dict):
        if isinstance(choice, dict) and (choice.get("type") != "function"
                                         or not isinstance(choice.get("name"), str)):
            raise UnsupportedParameter("tool_choice must be 'none', 'auto', 'required' or "
                                       "{'type': 'function', 'name': ...}", param="tool_choice")
        tag = forced_tag(tools, choice.get("name") if isinstance(choice, dict) else None,
                         parallel is not False, tool_parser)
    elif choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' "
                         "or a named function", param="tool_choice")
    schema = output_format((body.get("text") or {}).get("format"), "text.format", tag)
    constrained = tag is not None or schema is not None
    stop = (single_call_stop(tools, tool_parser, constrained)
            if parallel is False and parses_tools else ())
    check_strict([f"tools[{index}].strict" for index, tool in enumerate(body.get("tools") or ())
                  if tool.get("type") == "function" and tool.get("strict")],
                 parses_tools and not constrained)
    return OutputConstraint(tag, schema, stop)


def _ids(call_id: str) -> str:
    return call_id.removeprefix("call-")


def output_items(outcome: Outcome, body: dict[str, Any]) -> list[dict]:
    choice = outcome.choices[0]
    key = _ids(choice.call_id)
    items: list[dict] = []
    if choice.message.get("reasoning_content"):
        items.append(_reasoning_item(key, choice.message["reasoning_content"], body))
    if choice.message.get("content"):
        items.append(_message_item(key, choice.message["content"], "completed"))
    for number, tool in enumerate(choice.tool_calls):
        items.append(_call_item(key, number, tool["function"]["name"],
                                tool["function"]["arguments"], "completed"))
    return items


def _reasoning_item(key: str, text: str, body: dict[str, Any]) -> dict:
    item = {"type": "reasoning", "id": f"rs_{key}", "summary": [
        {"type": "summary_text", "text": text}] if wants_summary(body) else []}
    if wants_sealed(body):
        item["encrypted_content"] = seal(text)
    return item


def _message_item(key: str, text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{key}", "status": status, "role": "assistant",
            "content": [] if status != "completed" else
            [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(key: str, number: int, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{key}_{number}", "call_id": f"call_{key}_{number}",
            "name": name, "arguments": arguments, "status": status}


def response_body(call: CallRequest, body: dict, outcome: Outcome | None, call_id: str) -> dict:
    done = outcome is not None
    incomplete = done and (outcome.choices[0].finish_reason or {}).get("type") == "length"
    result = {"id": f"resp_{_ids(call_id)}", "object": "response", "created_at": 0,
              "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
              "model": call.model,
              "output": output_items(outcome, body) if done else [],
              "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
              "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
              "temperature": body.get("temperature"), "top_p": body.get("top_p"),
              "max_output_tokens": body.get("max_output_tokens"),
              "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
              "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
              "error": None, "text": {"format": {"type": "text"}}, "truncation": "disabled",
              "store": False, "usage": None}
    if done:
        result["usage"] = {"input_tokens": outcome.num_prompt_tokens,
                           "input_tokens_details": {"cached_tokens": outcome.num_cached_tokens},
                           "output_tokens": outcome.num_completion_tokens,
                           "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": outcome.num_prompt_tokens
                           + outcome.num_completion_tokens}
    return result


class ResponseStream:
    """Responses API stream events (an `EventFormatter`), numbered by `sequence_number`."""

    def __init__(self, call: CallRequest, body: dict):
        self.call, self.body = call, body
        self.sequence = 0
        self.call_id: str | None = None
        self.item: dict | None = None
        self.text = ""
        self.output_index = -1
        self.num_tools = 0
        self.summarized = wants_summary(body)

    def event(self, kind: str, **data) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return sse(payload, kind)

    def begin(self, call_id: str) -> list[bytes]:
        self.call_id = call_id
        response = response_body(self.call, self.body, None, call_id)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def error(self, error: GatewayError) -> bytes:
        return self.event("error", code=openai_error(error)["error"]["code"],
                          message=error.message, param=error.param)

    def _open(self, item: dict) -> list[bytes]:
        out = self._close()
        self.output_index += 1
        self.item, self.text = item, ""
        out.append(self.event("response.output_item.added", output_index=self.output_index,
                              item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=self.output_index, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))
        elif item["type"] == "reasoning" and self.summarized:
            out.append(self.event("response.reasoning_summary_part.added", item_id=item["id"],
                                  output_index=self.output_index, summary_index=0,
                                  part={"type": "summary_text", "text": ""}))
        return out

    def _close(self) -> list[bytes]:
        if self.item is None:
            return []
        item, at = self.item, {"item_id": self.item["id"], "output_index": self.output_index}
        out = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": []}
            out += [self.event("response.output_text.done", **at, content_index=0,
                               text=self.text),
                    self.event("response.content_part.done", **at, content_index=0, part=part)]
            item = {**_message_item(item["id"][4:], self.text, "completed")}
        elif item["type"] == "reasoning":
            part = {"type": "summary_text", "text": self.text}
            if self.summarized:
                out += [self.event("response.reasoning_summary_text.done", **at,
                                   summary_index=0, text=self.text),
                        self.event("response.reasoning_summary_part.done", **at,
                                   summary_index=0, part=part)]
            item = _reasoning_item(item["id"][3:], self.text, self.body)
        else:
            out.append(self.event("response.function_call_arguments.done", **at,
                                  arguments=item["arguments"]))
            item = {**item, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=self.output_index,
                              item=item))
        self.item = None
        return out

    def delta(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        key = _ids(delta.call_id)
        for event in delta.events:
            if isinstance(event, Reasoning | Content):
                kind = "reasoning" if isinstance(event, Reasoning) else "message"
                if self.item is None or self.item["type"] != kind:
                    out += self._open({"type": "reasoning", "id": f"rs_{key}", "summary": []}
                                      if kind == "reasoning"
                                      else _message_item(key, "", "in_progress"))
                self.text += event.text
                if kind == "reasoning" and not self.summarized:
                    continue  # kept for the item's encrypted_content
                name = ("response.reasoning_summary_text.delta" if kind == "reasoning"
                        else "response.output_text.delta")
                index = {"summary_index": 0} if kind == "reasoning" else {"content_index": 0}
                assert self.item is not None  # `_open` set it
                out.append(self.event(name, item_id=self.item["id"],
                                      output_index=self.output_index, delta=event.text, **index))
            elif isinstance(event, ToolCall):
                item = _call_item(key, self.num_tools, event.name, "", "in_progress")
                self.num_tools += 1
                out += self._open(item)
                item["arguments"] = event.arguments_json
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self.output_index,
                                      delta=event.arguments_json))
        return out

    def finish(self, outcome: Outcome) -> list[bytes]:
        assert self.call_id is not None  # `begin` set it
        response = response_body(self.call, self.body, outcome, self.call_id)
        kind = "response.completed" if response["status"] == "completed" else \
            "response.incomplete"
        return self._close() + [self.event(kind, response=response)]


def add_routes(app: web.Application, runner: CallRunner, sessions: SessionRegistry,
               config: GatewayConfig) -> None:
    async def create_response(request: web.Request) -> web.StreamResponse:
        session = session_of(request, sessions)
        body, raw = await read_json(request, config.max_body_bytes)
        call = parse_request(body, runner.tool_parser, runner.renderer.reads,
                             fingerprint=fingerprint(raw), is_retry=is_retry(request))
        return await reply_to_call(
            request, runner, session, call, bool(body.get("stream")), config.keepalive_s,
            lambda outcome: response_body(call, body, outcome, outcome.choices[0].call_id),
            lambda: ResponseStream(call, body))

    for prefix in ("", "/s/{session}"):
        app.router.add_post(f"{prefix}/v1/responses", create_response)
