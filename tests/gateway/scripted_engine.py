"""A scripted engine: a real aiohttp server speaking SGLang's native `/generate`
protocol (non-incremental streaming, as SGLang does by default) that replays
scripted completions as token IDs, one per SSE event.

The tiny model samples random text, so tests of tool calls, thinking blocks and
exact capture script the completion here (the fake sits at the outer edge: the
gateway's engine pool and client talk to it over HTTP as to any engine). It
remembers what it sent for each `rid`, so tests can compare the tree with it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from aiohttp import web

WEIGHT_VERSION = "7"


@dataclass
class Sent:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    sampling_params: dict


@dataclass
class ScriptedEngine:
    """Replays `scripts` in order (then `default`); `stop_token_ids` end a completion."""

    default: list[int]
    stop_token_ids: tuple[int, ...] = ()
    scripts: list[list[int]] = field(default_factory=list)
    sent: dict[str, Sent] = field(default_factory=dict)
    delay_s: float = 0.0
    num_requests: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.ok)
        for path in ("/abort_request", "/flush_cache", "/pause_generation",
                     "/continue_generation"):
            app.router.add_post(path, self.ok)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        return app

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "scripted", "weight_version": WEIGHT_VERSION})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": WEIGHT_VERSION})

    def _completion(self, params: dict) -> tuple[list[int], dict]:
        script = self.scripts.pop(0) if self.scripts else list(self.default)
        max_new = params.get("max_new_tokens")
        for index, token_id in enumerate(script):
            if token_id in self.stop_token_ids:
                script = script[:index + 1]
                if max_new is None or len(script) <= max_new:
                    return script, {"type": "stop", "matched": token_id}
                break
        if max_new is not None and len(script) >= max_new:
            return script[:max_new], {"type": "length", "length": max_new}
        return script, {"type": "stop", "matched": None}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.num_requests += 1
        rid = body.get("rid") or f"r{self.num_requests}"
        params = body.get("sampling_params") or {}
        output_ids, finish = self._completion(params)
        logprobs = [-0.001 * self.num_requests - 0.01 * (i + 1) for i in range(len(output_ids))]
        self.sent[rid] = Sent(list(body["input_ids"]), output_ids, logprobs, params)

        def reply(num: int, done: bool) -> dict:
            return {"text": "", "output_ids": output_ids[:num], "meta_info": {
                "id": rid, "finish_reason": finish if done else None,
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": num,
                "cached_tokens": 0, "weight_version": WEIGHT_VERSION,
                "output_token_logprobs": [[lp, t, None] for lp, t in
                                          zip(logprobs[:num], output_ids[:num], strict=True)]}}

        if not body.get("stream"):
            return web.json_response(reply(len(output_ids), True))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for num in range(1, len(output_ids) + 1):
            await asyncio.sleep(self.delay_s)
            await response.write(f"data: {json.dumps(reply(num, False))}\n\n".encode())
        await response.write(f"data: {json.dumps(reply(len(output_ids), True))}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response
