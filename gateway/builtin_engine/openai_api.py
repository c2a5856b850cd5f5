"""OpenAI-compatible routes of the built-in engine, as SGLang serves them beside its native API.

`POST /v1/completions`, `POST /v1/chat/completions` (streaming or not; the chat is rendered with
the model directory's chat template) and `GET /v1/models`, so that other proxies (LiteLLM) can be
measured against the same engine. SGLang's extras are accepted (`top_k`, `min_p`, `ignore_eos`,
`stop_token_ids`, `no_stop_trim`, `skip_special_tokens`, `min_tokens`), `seed` becomes
`sampling_seed`, choices carry `matched_stop`, and `return_token_ids: true` adds `token_ids` and
`prompt_token_ids` to the choice (vLLM's field) for token-exact clients.
"""

import contextlib
import time
import uuid

from aiohttp import web

from undertow.gateway.builtin_engine.errors import BadRequest
from undertow.gateway.builtin_engine.native_api import _sse, output_text, read_json
from undertow.gateway.builtin_engine.request import Request, parse_generate

_PASSED = ("temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
           "skip_special_tokens", "no_stop_trim", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "n")


class OpenAIApi:
    """Handlers of the OpenAI-compatible routes."""

    def __init__(self, engine):
        self.engine = engine

    async def models(self, http: web.Request) -> web.Response:
        name = self.engine.served_model_name
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "undertow", "root": name,
            "max_model_len": self.engine.context_length}]})

    async def completions(self, http: web.Request) -> web.StreamResponse:
        body = await read_json(http)
        top = body.get("logprobs")
        request = self._request(body, self._prompt_ids(body.get("prompt")), 16,
                                top if isinstance(top, int) and not isinstance(top, bool) else 0,
                                top is not None)
        return await self._respond(http, body, request, chat=False)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        body = await read_json(http)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("messages must be a non-empty list of objects with a role")
        extra = body.get("chat_template_kwargs") or {}
        text = self.engine.tokenizer.render_chat(messages, tools=body.get("tools"), **extra)
        top = body.get("top_logprobs") or 0
        request = self._request(body, self.engine.tokenizer.encode(text), None, top,
                                bool(body.get("logprobs")))
        return await self._respond(http, body, request, chat=True)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise BadRequest("prompt must be a string or a list of token IDs (one prompt per call)")

    def _request(self, body: dict, ids: list[int], default_max_tokens: int | None,
                 num_top: int, return_logprob: bool) -> Request:
        engine = self.engine
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = default_max_tokens or max(engine.context_length - len(ids), 0)
        params = {name: body[name] for name in _PASSED if body.get(name) is not None}
        params["max_new_tokens"] = max_tokens
        if body.get("min_tokens") is not None:
            params["min_new_tokens"] = body["min_tokens"]
        if body.get("seed") is not None:
            params["sampling_seed"] = body["seed"]
        if not isinstance(num_top, int) or isinstance(num_top, bool) or not 0 <= num_top <= 20:
            raise BadRequest("top_logprobs / logprobs must be an integer in [0, 20]")
        generate = {"input_ids": ids, "sampling_params": params,
                    "stream": bool(body.get("stream")), "return_logprob": return_logprob,
                    "top_logprobs_num": num_top, "rid": f"{uuid.uuid4().hex}"}
        requests, _ = parse_generate(generate, engine.tokenizer.encode, engine.vocab_size,
                                     engine.context_length)
        return requests[0]

    async def _respond(self, http, body: dict, request: Request, chat: bool):
        stream = _Stream(self.engine, body, request, chat)
        if not request.stream:
            num_tokens = await self.engine.run(request)
            return web.json_response(stream.full_reply(num_tokens))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(http)
        if chat:
            await response.write(_sse(stream.chunk({"role": "assistant", "content": ""}, None)))
        async with contextlib.aclosing(self.engine.updates(request)) as updates:
            async for num_tokens, finished in updates:
                for payload in stream.deltas(num_tokens, finished):
                    await response.write(_sse(payload))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _Stream:
    """Builds one call's OpenAI replies: the whole reply, or its stream of chunks."""

    def __init__(self, engine, body: dict, request: Request, chat: bool):
        self.engine, self.body, self.request, self.chat = engine, body, request, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request.rid
        self.created = int(time.time())
        self.model = body.get("model") or engine.served_model_name
        self.sent_tokens, self.sent_text = 0, ""

    def _finish(self) -> tuple[str | None, object]:
        reason = self.request.finish_reason or {}
        return reason.get("type"), reason.get("matched")

    def _logprobs(self, start: int, end: int):
        r, tokenizer = self.request, self.engine.tokenizer
        if not r.return_logprob:
            return None
        ids, values = r.output_ids[start:end], r.output_logprobs[start:end]
        tops = r.output_top_logprobs[start:end] if r.top_logprobs_num else [[]] * len(ids)
        texts = [tokenizer.token_text(t) for t in ids]
        if self.chat:
            return {"content": [{
                "token": text, "logprob": lp, "bytes": list(text.encode()),
                "top_logprobs": [{"token": tokenizer.token_text(t), "logprob": v,
                                  "bytes": list(tokenizer.token_text(t).encode())}
                                 for v, t in top]}
                for text, lp, top in zip(texts, values, tops, strict=True)]}
        return {"tokens": texts, "token_logprobs": values,
                "top_logprobs": [{tokenizer.token_text(t): v for v, t in top} for top in tops]
                if r.top_logprobs_num else None, "text_offset": None}

    def _usage(self, num_tokens: int) -> dict:
        r = self.request
        return {"prompt_tokens": len(r.input_ids), "completion_tokens": num_tokens,
                "total_tokens": len(r.input_ids) + num_tokens,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    @staticmethod
    def _choice(text: str | None, finish: str | None, matched, logprobs) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                "matched_stop": matched}

    def full_reply(self, num_tokens: int) -> dict:
        r = self.request
        text = output_text(self.engine.tokenizer, r, num_tokens, True)
        finish, matched = self._finish()
        logprobs = self._logprobs(0, num_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "tool_calls": None, "reasoning_content": None},
                      "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}
        else:
            choice = self._choice(text, finish, matched, logprobs)
        if self.body.get("return_token_ids"):
            choice["token_ids"] = r.output_ids[:num_tokens]
            choice["prompt_token_ids"] = r.input_ids
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(num_tokens), "weight_version": self.engine.weight_version}

    def chunk(self, delta, finish: str | None, matched=None, logprobs=None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                      "matched_stop": matched}
        else:
            choice = self._choice(delta, finish, matched, logprobs)
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [choice]}

    def deltas(self, num_tokens: int, finished: bool) -> list[dict]:
        """The chunks that bring the client from what it has to `num_tokens` outputs."""
        text = output_text(self.engine.tokenizer, self.request, num_tokens, finished)
        if not finished and text.endswith("\ufffd"):
            return []  # an incomplete UTF-8 character: wait for the bytes that complete it
        delta = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        logprobs = self._logprobs(self.sent_tokens, num_tokens)
        self.sent_text, self.sent_tokens = text, num_tokens
        finish, matched = self._finish() if finished else (None, None)
        chunks = []
        if delta or logprobs or finished:
            chunks.append(self.chunk({"content": delta} if self.chat else delta, finish, matched,
                                     logprobs))
        options = self.body.get("stream_options") or {}
        if finished and options.get("include_usage"):
            usage = self.chunk(None, None)
            usage["choices"], usage["usage"] = [], self._usage(num_tokens)
            chunks.append(usage)
        if finished and self.body.get("return_token_ids") and chunks:
            chunks[0]["choices"][0]["token_ids"] = self.request.output_ids[:num_tokens]
        return chunks


def add_routes(app: web.Application, engine) -> None:
    api = OpenAIApi(engine)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)

