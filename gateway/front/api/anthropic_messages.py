"""`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic Messages API): blocks
to the internal chat form and back, streamed as Anthropic's events with `ping`
keep-alives. What each field becomes: docs/api.md, "Request fields". Translated here, not by
litellm, whose import takes seconds and whose translation grows with the history on every
call.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from undertow.gateway.errors import BadRequest, GatewayError, UnsupportedParameter
from undertow.gateway.front.api.anthropic_options import (
    check_context_management,
    output_schema,
    template_kwargs_of,
    thinking_omitted,
)
from undertow.gateway.front.api.common import (
    fingerprint,
    is_retry,
    read_json,
    reply_to_call,
    session_of,
    sse,
)
from undertow.gateway.front.api.errors import anthropic_error
from undertow.gateway.front.api.openai_chat import sampling_fields
from undertow.gateway.front.api.output_options import (
    OutputConstraint,
    check_strict,
    check_value,
    forced_tag,
    json_output,
    single_call_stop,
)
from undertow.gateway.front.api.sealed_reasoning import MARKER, seal, unseal
from undertow.gateway.front.calls import CallRequest, CallRunner, Choice, Delta, Outcome
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.toolparsers import Content, Reasoning, ToolCall

# Every accepted field, and how each is honoured (or why refused), is in the README's
# "Request fields" table; anything else is refused by name. `metadata` labels a call for
# the provider and changes no output.
ACCEPTED = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature",
            "top_p", "top_k", "stream", "tools", "tool_choice", "thinking", "metadata",
            "service_tier", "context_management", "container", "mcp_servers", "output_config",
            "output_format"}
SIGNATURE = "undertow"


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of blocks",
                         param="messages")
    return content


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for block in _blocks(content, where):
        if block.get("type") != "text":
            raise UnsupportedParameter(f"{where}: tool_result blocks of type "
                                       f"{block.get('type')!r} are not supported (text only)",
                                       param="messages")
        texts.append(block.get("text", ""))
    return "".join(texts)


def _assistant(blocks: list[dict], where: str) -> dict:
    texts, thinking, calls = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            signature = block.get("signature")
            thinking.append(block.get("thinking") or (
                unseal(signature, f"{where}.signature")
                if isinstance(signature, str) and signature.startswith(MARKER) else ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": json.dumps(block.get("input") or {},
                                                               ensure_ascii=False)}})
        elif kind != "redacted_thinking":
            raise UnsupportedParameter(f"{where}: block type {kind!r} is not supported",
                                       param="messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict], where: str) -> list[dict]:
    messages, texts = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                             "content": _tool_result_text(block.get("content"), where)})
        elif kind == "text":
            texts.append(block.get("text", ""))
        else:
            raise UnsupportedParameter(f"{where}: block type {kind!r} is not supported "
                                       "(text and tool_result only)", param="messages")
    if texts or not messages:
        messages.append({"role": "user", "content": "".join(texts)})
    return messages


def to_chat_messages(body: dict[str, Any]) -> list[dict]:
    """Anthropic system + messages -> internal chat messages."""
    messages = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else "".join(
            block.get("text", "") for block in _blocks(system, "system"))
        messages.append({"role": "system", "content": text})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRequest("messages: must be a non-empty list", param="messages")
    for index, turn in enumerate(turns):
        where = f"messages.{index}"
        # Claude Code also sends `system` turns between the others (agent listings).
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"{where}: role must be 'user', 'assistant' or 'system'",
                             param="messages")
        blocks = _blocks(turn.get("content"), where)
        if turn["role"] == "system":
            messages.append({"role": "system",
                             "content": "".join(block.get("text", "") for block in blocks)})
        elif turn["role"] == "assistant":
            messages.append(_assistant(blocks, where))
        else:
            messages.extend(_user(blocks, where))
    return messages


def to_chat_tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "name" in t for t in tools):
        raise BadRequest("tools: each tool needs a name and an input_schema", param="tools")
    for index, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):  # e.g. web_search_20250305, bash_...
            raise UnsupportedParameter(f"tools.{index}.type: {tool['type']!r} is a tool the "
                                       "API provider runs; this gateway runs none (send it "
                                       "as a custom tool with an input_schema)", param="tools")
    return [{"type": "function", "function": {"name": t["name"],
                                              "description": t.get("description", ""),
                                              "parameters": t.get("input_schema") or {}}}
            for t in tools]


def output_constraint(body: dict[str, Any], tools: list[dict] | None, tool_parser: str
                      ) -> OutputConstraint:
    """`tool_choice` (auto, none, any, tool) and `output_config.format` or
    `output_format` (see `output_options`)."""
    choice = body.get("tool_choice") or {}
    kind = choice.get("type", "auto") if isinstance(choice, dict) else None
    if kind not in ("auto", "none", "any", "tool"):
        raise BadRequest("tool_choice.type must be 'auto', 'none', 'any' or 'tool'",
                         param="tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    tag = None
    if kind in ("any", "tool"):
        name = choice.get("name") if kind == "tool" else None
        if kind == "tool" and not isinstance(name, str):
            raise BadRequest("tool_choice.name: Field required", param="tool_choice")
        tag = forced_tag(tools, name, parallel, tool_parser)
    param_schema = output_schema(body)
    schema = json_output(param_schema[1], param_schema[0], tag) if param_schema else None
    constrained = tag is not None or schema is not None
    stop = (single_call_stop(tools, tool_parser, constrained)
            if not parallel and kind == "auto" else ())
    check_strict([f"tools.{index}.strict" for index, tool in enumerate(body.get("tools") or ())
                  if tool.get("strict")], kind != "none" and not constrained)
    return OutputConstraint(tag, schema, stop)


def parse_request(body: dict[str, Any], count_only: bool = False, tool_parser: str = "hermes",
                  *, fingerprint: str = "", is_retry: bool = False) -> CallRequest:
    """The call a Messages request asks for, built once everything that shapes it is known;
    `fingerprint` and `is_retry` as `common.fingerprint` and `common.is_retry` give them."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise UnsupportedParameter(f"{unknown[0]}: Extra inputs are not permitted",
                                   param=unknown[0])
    for name in ("mcp_servers", "container"):  # tools the API provider runs: none here
        if body.get(name):
            raise UnsupportedParameter(f"{name}: not supported by this gateway (it runs no "
                                       "server-side tools); omit it", param=name)
    check_value(body.get("service_tier"), ("auto", "standard_only"), "service_tier",
                "the gateway has one service tier")
    check_context_management(body.get("context_management"))
    if not isinstance(body.get("model"), str):
        raise BadRequest("model: Field required", param="model")
    if not count_only and not isinstance(body.get("max_tokens"), int):
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    choice = body.get("tool_choice") or {}
    sampling = sampling_fields(body, ("max_tokens",))
    messages = to_chat_messages(body)
    tools = to_chat_tools(body.get("tools"))
    template = template_kwargs_of(body)
    output = output_constraint(body, tools, tool_parser)
    return CallRequest(api="messages", model=body["model"],
                       sampling=output.sampling_params(sampling), messages=messages,
                       tools=tools,
                       parse_tools=not isinstance(choice, dict) or choice.get("type") != "none",
                       fingerprint=fingerprint, is_retry=is_retry, template_kwargs=template)


def _tool_use_id(call_id: str, index: int) -> str:
    return f"toolu_{call_id.removeprefix('call-')}_{index}"


def stop_reason(choice: Choice) -> tuple[str, str | None]:
    finish = choice.finish_reason or {}
    if finish.get("type") == "length":
        return "max_tokens", None
    if choice.tool_calls:
        return "tool_use", None
    if isinstance(finish.get("matched"), str):
        return "stop_sequence", finish["matched"]
    return "end_turn", None


def thinking_block(text: str, omitted: bool) -> dict:
    if omitted:
        return {"type": "thinking", "thinking": "", "signature": seal(text)}
    return {"type": "thinking", "thinking": text, "signature": SIGNATURE}


def message_body(call: CallRequest, body: dict[str, Any], outcome: Outcome) -> dict:
    choice = outcome.choices[0]
    content: list[dict] = []
    if choice.message.get("reasoning_content"):
        content.append(thinking_block(choice.message["reasoning_content"],
                                      thinking_omitted(body)))
    if choice.message.get("content"):
        content.append({"type": "text", "text": choice.message["content"]})
    for number, tool in enumerate(choice.tool_calls):
        content.append({"type": "tool_use", "id": _tool_use_id(choice.call_id, number),
                        "name": tool["function"]["name"],
                        "input": json.loads(tool["function"]["arguments"])})
    reason, sequence = stop_reason(choice)
    return {"id": f"msg_{choice.call_id.removeprefix('call-')}", "type": "message",
            "role": "assistant", "model": call.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(outcome)}


def usage(outcome: Outcome) -> dict:
    return {"input_tokens": outcome.num_prompt_tokens,
            "output_tokens": outcome.num_completion_tokens,
            "cache_read_input_tokens": outcome.num_cached_tokens,
            "cache_creation_input_tokens": 0}


class MessageStream:
    """Anthropic stream events (an `EventFormatter`): one content block per run of
    same-kind events."""

    def __init__(self, call: CallRequest, omit_thinking: bool = False):
        self.call = call
        self.block: str | None = None
        self.index = -1
        self.num_tools = 0
        self.omit_thinking = omit_thinking
        self.thinking = ""  # the open thinking block's text (sealed when omitted)

    def begin(self, call_id: str) -> list[bytes]:
        return [sse({"type": "message_start", "message": {
            "id": f"msg_{call_id.removeprefix('call-')}", "type": "message", "role": "assistant",
            "model": self.call.model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}, "message_start")]

    def _open(self, kind: str, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.block = kind
        out.append(sse({"type": "content_block_start", "index": self.index,
                        "content_block": block}, "content_block_start"))
        return out

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":
            signature = seal(self.thinking) if self.omit_thinking else SIGNATURE
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
        out.append(sse({"type": "content_block_stop", "index": self.index},
                       "content_block_stop"))
        self.block = None
        return out

    def _delta(self, delta: dict) -> bytes:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                   "content_block_delta")

    def delta(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for event in delta.events:
            if isinstance(event, Reasoning):
                if self.block != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""})
                    self.thinking = ""
                self.thinking += event.text
                if not self.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, Content):
                if self.block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCall):
                out += self._open("tool_use", {
                    "type": "tool_use", "id": _tool_use_id(delta.call_id, self.num_tools),
                    "name": event.name, "input": {}})
                self.num_tools += 1
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.arguments_json}))
        return out

    def keepalive(self) -> bytes:
        return sse({"type": "ping"}, "ping")

    def error(self, error: GatewayError) -> bytes:
        return sse(anthropic_error(error), "error")

    def finish(self, outcome: Outcome) -> list[bytes]:
        reason, sequence = stop_reason(outcome.choices[0])
        return self._close() + [
            sse({"type": "message_delta", "delta": {"stop_reason": reason,
                                                    "stop_sequence": sequence},
                 "usage": usage(outcome)}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]


def add_routes(app: web.Application, runner: CallRunner, sessions: SessionRegistry,
               config: GatewayConfig) -> None:
    async def messages(request: web.Request) -> web.StreamResponse:
        session = session_of(request, sessions)
        body, raw = await read_json(request, config.max_body_bytes)
        call = parse_request(body, tool_parser=runner.tool_parser,
                             fingerprint=fingerprint(raw), is_retry=is_retry(request))
        return await reply_to_call(
            request, runner, session, call, bool(body.get("stream")), config.keepalive_s,
            lambda outcome: message_body(call, body, outcome),
            lambda: MessageStream(call, thinking_omitted(body)))

    async def count_tokens(request: web.Request) -> web.Response:
        session_of(request, sessions)
        body, _ = await read_json(request, config.max_body_bytes)
        call = parse_request(body, count_only=True, tool_parser=runner.tool_parser)
        text = runner.renderer.with_kwargs(call.template_kwargs).render(
            call.messages or [], call.tools, add_generation_prompt=True)
        return web.json_response({"input_tokens": len(runner.renderer.encode(text))})

    for prefix in ("", "/s/{session}"):
        app.router.add_post(f"{prefix}/v1/messages", messages)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", count_tokens)
