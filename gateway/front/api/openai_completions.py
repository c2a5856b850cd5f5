"""`POST /v1/completions` (OpenAI legacy text completions), streaming and not.

The prompt is a string (encoded as is, no chat template) or a list of token IDs
(sent verbatim). The tree shares whatever prefix the prompt has with earlier calls;
there is no message-level token truth here, since there are no messages.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from undertow.gateway.engines.protocol import SamplingParams
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
from undertow.gateway.front.api.openai_chat import sampling_fields, usage
from undertow.gateway.front.api.output_options import stream_options
from undertow.gateway.front.calls import CallRequest, CallRunner, Delta, Outcome
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.sessions import SessionRegistry
from undertow.gateway.front.toolparsers import Content

ACCEPTED = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
            "seed", "stream", "stream_options", "logprobs", "user", "frequency_penalty",
            "presence_penalty", "logit_bias", "echo", "best_of", "suffix"}


def _prompt_ids(runner: CallRunner, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        return runner.renderer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a string or a list of token IDs (one prompt per call)",
                     param="prompt")


def parse_request(runner: CallRunner, body: dict[str, Any], max_n: int, *,
                  fingerprint: str = "", is_retry: bool = False) -> CallRequest:
    """The call a completions request asks for, built once; `fingerprint` and `is_retry`
    as `common.fingerprint` and `common.is_retry` give them."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise UnsupportedParameter(f"Unrecognized request argument supplied: {unknown[0]}",
                                   param=unknown[0])
    for name in ("echo", "suffix"):
        if body.get(name):
            raise UnsupportedParameter(f"{name} is not supported; omit it", param=name)
    if body.get("best_of") not in (None, 1):
        raise UnsupportedParameter("best_of is not supported; use n", param="best_of")
    stream_options(body.get("stream_options"), {"include_usage", "include_obfuscation"})
    if not isinstance(body.get("model"), str):
        raise BadRequest("model must be a string", param="model")
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= max_n:
        raise BadRequest(f"n must be an integer in 1..{max_n}", param="n")
    sampling = sampling_fields(body, ("max_tokens",))
    if sampling["max_new_tokens"] is None:
        sampling["max_new_tokens"] = 16  # the legacy API's default
    return CallRequest(api="completions", model=body["model"],
                       sampling=SamplingParams(**sampling),
                       prompt_ids=_prompt_ids(runner, body.get("prompt")), n=n,
                       fingerprint=fingerprint, is_retry=is_retry)


def _finish(choice) -> str:
    return "length" if (choice.finish_reason or {}).get("type") == "length" else "stop"


def _logprobs(runner: CallRunner, token_ids: list[int], logprobs: list[float]) -> dict:
    tokens = [runner.renderer.decode([t], skip_special_tokens=False) for t in token_ids]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
            "text_offset": []}


def completion_body(runner: CallRunner, call: CallRequest, outcome: Outcome,
                    want_logprobs: bool) -> dict:
    return {"id": f"cmpl-{outcome.choices[0].call_id}", "object": "text_completion",
            "created": outcome.created_s, "model": call.model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": _finish(c),
                         "logprobs": _logprobs(runner, c.token_ids, c.logprobs)
                         if want_logprobs else None} for c in outcome.choices],
            "usage": usage(outcome)}


def add_routes(app: web.Application, runner: CallRunner, sessions: SessionRegistry,
               config: GatewayConfig) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        session = session_of(request, sessions)
        body, raw = await read_json(request, config.max_body_bytes)
        call = parse_request(runner, body, config.max_n, fingerprint=fingerprint(raw),
                             is_retry=is_retry(request))
        want_logprobs = body.get("logprobs") is not None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return await reply_to_call(
            request, runner, session, call, bool(body.get("stream")), config.keepalive_s,
            lambda outcome: completion_body(runner, call, outcome, want_logprobs),
            lambda: CompletionStream(runner, call, want_logprobs, include_usage))

    for prefix in ("", "/s/{session}"):
        app.router.add_post(f"{prefix}/v1/completions", completions)


class CompletionStream:
    """Formats deltas and the outcome as `text_completion` SSE events (an
    `EventFormatter`); the stream has no opening event."""

    def __init__(self, runner: CallRunner, call: CallRequest, want_logprobs: bool,
                 include_usage: bool):
        self.runner, self.call = runner, call
        self.want_logprobs, self.include_usage = want_logprobs, include_usage

    def chunk(self, call_id: str, choices: list[dict], **extra) -> bytes:
        return sse({"id": f"cmpl-{call_id}", "object": "text_completion", "created": 0,
                    "model": self.call.model, "choices": choices, **extra})

    def begin(self, call_id: str) -> list[bytes]:
        return []

    def delta(self, delta: Delta) -> list[bytes]:
        text = "".join(e.text for e in delta.events if isinstance(e, Content))
        if not text and not (self.want_logprobs and delta.token_ids):
            return []
        logprobs = (_logprobs(self.runner, delta.token_ids, delta.logprobs)
                    if self.want_logprobs else None)
        return [self.chunk(delta.call_id, [{"index": delta.index, "text": text,
                                            "finish_reason": None, "logprobs": logprobs}])]

    def finish(self, outcome: Outcome) -> list[bytes]:
        call_id = outcome.choices[0].call_id
        out = [self.chunk(call_id, [{"index": choice.index, "text": "", "logprobs": None,
                                     "finish_reason": _finish(choice)}])
               for choice in outcome.choices]
        if self.include_usage:
            out.append(self.chunk(call_id, [], usage=usage(outcome)))
        return out + [sse("[DONE]")]

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def error(self, error: GatewayError) -> bytes:
        return sse(openai_error(error))
