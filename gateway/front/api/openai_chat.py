"""`POST /v1/chat/completions` (OpenAI Chat Completions), streaming and not.

Request -> `CallRequest` (internal chat form = OpenAI messages with
`reasoning_content`), then the `CallRunner`'s deltas become `chat.completion.chunk`
events as they are sampled (tool calls as one `tool_calls` delta each, with name
and full arguments, which the OpenAI SDK's and litellm's stream accumulators
handle), and the `Outcome` becomes the finish chunks, usage and `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from undertow.gateway.errors import BadRequest, GatewayError, UnsupportedParameter
from undertow.gateway.front.api.common import (
    fingerprint,
    is_retry,
    json_object,
    read_body,
    reply_to_call,
    session_of,
    sse,
)
from undertow.gateway.front.api.errors import openai_error
from undertow.gateway.front.api.output_options import (
    OutputConstraint,
    check_strict,
    check_value,
    forced_tag,
    output_format,
    single_call_stop,
    stream_options,
    template_kwargs,
    template_variable,
)
from undertow.gateway.front.api.resent_body import KnownBody, parse_resent
from undertow.gateway.front.calls import (
    CallRequest,
    CallRunner,
    Choice,
    Delta,
    Outcome,
)
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.toolparsers import Content, Reasoning, ToolCall

ACCEPTED = {"model", "messages", "tools", "tool_choice", "n", "stop", "logprobs", "top_logprobs",
            "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
            "stream", "stream_options", "user", "metadata", "store", "parallel_tool_calls",
            "frequency_penalty", "presence_penalty", "response_format", "reasoning_effort",
            "service_tier", "logit_bias", "extra_body", "chat_template_kwargs", "verbosity"}
# Every accepted field, and how each is honoured (or why refused), is in the README's
# "Request fields" table; `user`, `metadata` and `store` label a call for the provider and
# change no output (every call is recorded in the tree whatever `store` says).
ROLES = {"system", "developer", "user", "assistant", "tool"}


def sampling_fields(body: dict[str, Any], max_tokens_fields: tuple[str, ...]) -> dict[str, Any]:
    """The sampling fields shared by the OpenAI-style APIs, validated, by `SamplingParams`'
    names: with what the output options add (`OutputConstraint.sampling_params`), the
    call's one `SamplingParams`, built once and carried as it is to the engine driver."""
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name):
            raise UnsupportedParameter(f"{name} is not supported by this gateway; omit it",
                                       param=name)
    if body.get("logit_bias"):
        raise UnsupportedParameter("logit_bias is not supported; omit it", param="logit_bias")
    max_tokens = next((body[f] for f in max_tokens_fields if body.get(f) is not None), None)
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}",
                         param=max_tokens_fields[0])
    stop = body.get("stop") or body.get("stop_sequences") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(item, str) for item in stop):
        raise BadRequest("stop must be a string or a list of strings", param="stop")
    values: dict[str, Any] = {}
    for name, kind, low, high in (("temperature", float, 0.0, 2.0), ("top_p", float, 0.0, 1.0),
                                  ("top_k", int, -1, 1 << 20)):
        value = body.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not low <= value <= high):
            raise BadRequest(f"{name} must be a number in [{low}, {high}], got {value!r}",
                             param=name)
        values[name] = kind(value)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"seed must be an integer, got {seed!r}", param="seed")
    return {"max_new_tokens": max_tokens, "stop": stop, "sampling_seed": seed, **values}


def _content_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                raise UnsupportedParameter(f"{where}: content part type {kind!r} is not "
                                           "supported (text only)", param="messages")
            texts.append(part.get("text", ""))
        return "".join(texts)
    raise BadRequest(f"{where}: content must be a string or a list of parts", param="messages")


@dataclass(frozen=True)
class KnownMessages:
    """A session's previous request's messages: as sent (`raw`) and parsed (`parsed`,
    one per raw message, never mutated), and its body (`body`, which the next one may
    extend: `resent_body.py`)."""

    raw: list
    parsed: list[dict]
    body: KnownBody | None = None


def parse_messages(messages: Any, known: KnownMessages | None = None) -> list[dict]:
    """OpenAI chat messages -> internal chat form (validated, text only). When they
    begin with `known.raw` (a scaffold re-sending its history), those reuse their parsed
    form (the same objects: equal JSON parses to equal messages; the comparison runs in
    C) and only the rest is parsed, so the cost follows the new messages."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    result: list[dict] = []
    if known is not None and len(known.raw) <= len(messages) and (
            messages[:len(known.raw)] == known.raw):
        result = list(known.parsed)
    for index in range(len(result), len(messages)):
        message, where = messages[index], f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object with a role in {sorted(ROLES)}",
                             param="messages")
        role = "system" if message["role"] == "developer" else message["role"]
        item: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"),
                                                                       where)}
        if role == "assistant":
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                item["reasoning_content"] = reasoning
            if message.get("tool_calls"):
                item["tool_calls"] = [_tool_call(call, where) for call in message["tool_calls"]]
        if role == "tool":
            item["tool_call_id"] = message.get("tool_call_id")
        result.append(item)
    return result


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where}: each tool call needs function.name", param="messages")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": function.get("arguments") or "{}"}}


def parse_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(tool, dict) and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict) for tool in tools):
        raise BadRequest("tools must be a list of {'type': 'function', 'function': {...}}",
                         param="tools")
    return tools or None


def reads_nothing(name: str) -> bool:
    """A template that reads no optional argument (`Renderer.reads` of such a one)."""
    return False


def check_request_options(body: dict[str, Any]) -> None:
    """The request-level fields that change nothing the model sees, where only some
    values can be honoured."""
    if "extra_body" in body:
        raise UnsupportedParameter("extra_body is an argument of the OpenAI SDKs, not a "
                                   "request field: put its fields at the top level of the "
                                   "body", param="extra_body")
    check_value(body.get("service_tier"), ("auto", "default"), "service_tier",
                "the gateway has one service tier")
    stream_options(body.get("stream_options"), {"include_usage", "include_obfuscation"})


def parse_request(body: dict[str, Any], max_n: int, known: KnownMessages | None = None,
                  tool_parser: str = "hermes", reads: Callable[[str], bool] = reads_nothing,
                  *, fingerprint: str = "", is_retry: bool = False) -> CallRequest:
    """The call a chat request asks for, built once everything that shapes it is known;
    `tool_parser` is the gateway's (its format's end of a call stops a request that allows
    one call at most); `reads` says which optional arguments the model's template takes
    (`Renderer.reads`); `fingerprint` and `is_retry` as `common.fingerprint` and
    `common.is_retry` give them."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise UnsupportedParameter(f"Unrecognized request argument supplied: {unknown[0]}",
                                   param=unknown[0])
    check_request_options(body)
    if not isinstance(body.get("model"), str):
        raise BadRequest("model must be a string", param="model")
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= max_n:
        raise BadRequest(f"n must be an integer in 1..{max_n}", param="n")
    if body.get("top_logprobs"):
        raise UnsupportedParameter("top_logprobs is not supported; use logprobs=true",
                                   param="top_logprobs")
    kwargs = template_kwargs(body.get("chat_template_kwargs"), body.get("reasoning_effort"))
    sampling = sampling_fields(body, ("max_completion_tokens", "max_tokens"))
    messages = parse_messages(body.get("messages"), known)
    tools = parse_tools(body.get("tools"))
    template = template_variable(kwargs, reads, "verbosity", body.get("verbosity"), "verbosity")
    parse = body.get("tool_choice") != "none"
    output = output_constraint(body, tools, parse and bool(tools), tool_parser)
    return CallRequest(api="chat", model=body["model"], sampling=output.sampling_params(sampling),
                       messages=messages, tools=tools, parse_tools=parse, n=n,
                       fingerprint=fingerprint, is_retry=is_retry, template_kwargs=template)


def output_constraint(body: dict[str, Any], tools: list[dict] | None, parses_tools: bool,
                      tool_parser: str) -> OutputConstraint:
    """`tool_choice`, `parallel_tool_calls` and `response_format` (see `output_options`)."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    tag = None
    if choice == "required" or isinstance(choice, dict):
        function = (choice.get("function") or {}) if isinstance(choice, dict) else {}
        if isinstance(choice, dict) and (choice.get("type") != "function"
                                         or not isinstance(function.get("name"), str)):
            raise BadRequest("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}",
                             param="tool_choice")
        tag = forced_tag(tools, function.get("name"), parallel is not False, tool_parser)
    elif choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' "
                         "or a named function", param="tool_choice")
    schema = output_format(body.get("response_format"), "response_format", tag)
    constrained = tag is not None or schema is not None
    stop = (single_call_stop(tools, tool_parser, constrained)
            if parallel is False and parses_tools else ())
    check_strict([f"tools[{index}].function.strict" for index, tool in enumerate(tools or ())
                  if tool["function"].get("strict")], parses_tools and not constrained)
    return OutputConstraint(tag, schema, stop)


def finish_reason(choice: Choice) -> str:
    kind = (choice.finish_reason or {}).get("type")
    if kind == "length":
        return "length"
    return "tool_calls" if choice.tool_calls else "stop"


def tool_call_id(call_id: str, index: int) -> str:
    return f"call_{call_id.removeprefix('call-')}_{index}"


def logprobs_content(runner: CallRunner, token_ids: list[int], logprobs: list[float]) -> list[dict]:
    items = []
    for token_id, logprob in zip(token_ids, logprobs, strict=True):
        text = runner.renderer.decode([token_id], skip_special_tokens=False)
        items.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                      "top_logprobs": []})
    return items


def completion_body(runner: CallRunner, request: CallRequest, outcome: Outcome,
                    want_logprobs: bool) -> dict:
    choices = []
    for choice in outcome.choices:
        message = dict(choice.message)
        for number, call in enumerate(message.get("tool_calls") or []):
            call["id"] = tool_call_id(choice.call_id, number)
        choices.append({"index": choice.index, "message": message,
                        "logprobs": {"content": logprobs_content(runner, choice.token_ids,
                                                                 choice.logprobs)}
                        if want_logprobs else None,
                        "finish_reason": finish_reason(choice)})
    return {"id": f"chatcmpl-{outcome.choices[0].call_id}", "object": "chat.completion",
            "created": outcome.created_s, "model": request.model, "choices": choices,
            "usage": usage(outcome), "system_fingerprint": None}


def usage(outcome: Outcome) -> dict:
    return {"prompt_tokens": outcome.num_prompt_tokens,
            "completion_tokens": outcome.num_completion_tokens,
            "total_tokens": outcome.num_prompt_tokens + outcome.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.num_cached_tokens}}


class ChatStream:
    """Formats deltas and the outcome as `chat.completion.chunk` SSE events (an
    `EventFormatter`)."""

    def __init__(self, runner: CallRunner, request: CallRequest, want_logprobs: bool,
                 include_usage: bool):
        self.runner, self.request = runner, request
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.chunk_id: str | None = None
        self.num_tool_calls: dict[int, int] = {}

    def chunk(self, choices: list[dict], **extra) -> bytes:
        return sse({"id": self.chunk_id, "object": "chat.completion.chunk", "created": 0,
                    "model": self.request.model, "choices": choices, **extra})

    def begin(self, call_id: str) -> list[bytes]:
        self.chunk_id = f"chatcmpl-{call_id}"
        return [self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                            for index in range(self.request.n)])]

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def error(self, error: GatewayError) -> bytes:
        return sse(openai_error(error))

    def delta(self, delta: Delta) -> list[bytes]:
        out = []
        text = "".join(e.text for e in delta.events if isinstance(e, Content))
        reasoning = "".join(e.text for e in delta.events if isinstance(e, Reasoning))
        logprobs = ({"content": logprobs_content(self.runner, delta.token_ids, delta.logprobs)}
                    if self.want_logprobs and delta.token_ids else None)
        if reasoning:
            out.append(self._choice(delta.index, {"reasoning_content": reasoning}))
        if text or logprobs:
            out.append(self._choice(delta.index, {"content": text}, logprobs=logprobs))
        for event in delta.events:
            if isinstance(event, ToolCall):
                number = self.num_tool_calls.get(delta.index, 0)
                self.num_tool_calls[delta.index] = number + 1
                out.append(self._choice(delta.index, {"tool_calls": [{
                    "index": number, "id": tool_call_id(delta.call_id, number),
                    "type": "function",
                    "function": {"name": event.name, "arguments": event.arguments_json}}]}))
        return out

    def _choice(self, index: int, delta: dict, logprobs=None, finish=None) -> bytes:
        return self.chunk([{"index": index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": finish}])

    def finish(self, outcome: Outcome) -> list[bytes]:
        out = [self._choice(choice.index, {}, finish=finish_reason(choice))
               for choice in outcome.choices]
        if self.include_usage:
            out.append(self.chunk([], usage=usage(outcome)))
        return out + [sse("[DONE]")]


def add_routes(app: web.Application, runner: CallRunner, sessions: SessionRegistry,
               config: GatewayConfig) -> None:
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        session = session_of(request, sessions)
        raw = await read_body(request, config.max_body_bytes)
        known = session.known_messages.get("chat")
        body, known_body = parse_resent(raw, known.body if known else None,
                                        whole=json_object)
        call = parse_request(body, config.max_n, known, runner.tool_parser,
                             runner.renderer.reads,
                             fingerprint=fingerprint(raw, known_body.digest if known_body
                                                     else None),
                             is_retry=is_retry(request))
        session.known_messages["chat"] = KnownMessages(body["messages"], call.messages or [],
                                                       known_body)
        want_logprobs = bool(body.get("logprobs"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await reply_to_call(
            request, runner, session, call, bool(body.get("stream")), config.keepalive_s,
            lambda outcome: completion_body(runner, call, outcome, want_logprobs),
            lambda: ChatStream(runner, call, want_logprobs, include_usage))

    for prefix in ("", "/s/{session}"):
        app.router.add_post(f"{prefix}/v1/chat/completions", chat_completions)
