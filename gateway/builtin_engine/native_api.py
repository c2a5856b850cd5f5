"""SGLang's native HTTP routes on the built-in engine (reply shapes: see `server.py`)."""

import asyncio
import contextlib
import json
import time
from pathlib import Path

from aiohttp import web

from undertow.gateway.builtin_engine.errors import BadRequest, WeightLoadError
from undertow.gateway.builtin_engine.memory import return_freed_memory
from undertow.gateway.builtin_engine.model import load_weights
from undertow.gateway.builtin_engine.request import Request, parse_generate
from undertow.gateway.builtin_engine.sampling import RequestSampling, make_generator

HEALTH_TIMEOUT_S = 20.0
PAUSE_MODES = ("abort", "retract", "in_place")


def output_text(tokenizer, request: Request, num_tokens: int, finished: bool) -> str:
    """The text of the first `num_tokens` outputs; a finished request's matched stop token or
    stop string is trimmed (SGLang's detokenizer does the same), unless `no_stop_trim`."""
    ids = request.output_ids[:num_tokens]
    matched = (request.finish_reason or {}).get("matched") if finished else None
    trim = not request.params.no_stop_trim
    if trim and isinstance(matched, int) and not isinstance(matched, bool) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, request.params.skip_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[:text.find(matched)]
    return text


def _entries(tokenizer, request: Request, logprobs, token_ids) -> list:
    with_text = request.return_text_in_logprobs
    return [[lp, t, tokenizer.token_text(t) if with_text else None]
            for lp, t in zip(logprobs, token_ids, strict=True)]


def _top_entries(tokenizer, request: Request, tops) -> list:
    with_text = request.return_text_in_logprobs
    return [None if top is None else
            [[lp, t, tokenizer.token_text(t) if with_text else None] for lp, t in top]
            for top in tops]


def sglang_reply(engine, request: Request, num_tokens: int, finished: bool,
                 start: int = 0) -> dict:
    """A `/generate` reply for the first `num_tokens` outputs; `start` > 0 makes the token
    lists and text deltas from output `start` on (incremental streaming)."""
    tokenizer = engine.tokenizer
    meta = {
        "id": request.rid,
        "finish_reason": request.finish_reason if finished else None,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": num_tokens,
        "cached_tokens": request.cached_tokens,
        "weight_version": engine.weight_version,
    }
    if request.return_logprob:
        ids = request.output_ids[start:num_tokens]
        meta["output_token_logprobs"] = _entries(
            tokenizer, request, request.output_logprobs[start:num_tokens], ids)
        if start == 0:
            first = max(request.logprob_start_len, 0)
            meta["input_token_logprobs"] = _entries(
                tokenizer, request, request.input_logprobs, request.input_ids[first:]
            ) if request.input_logprobs else []
        if request.top_logprobs_num:
            meta["output_top_logprobs"] = _top_entries(
                tokenizer, request, request.output_top_logprobs[start:num_tokens])
            if start == 0:
                meta["input_top_logprobs"] = _top_entries(
                    tokenizer, request, request.input_top_logprobs)
    if finished:
        meta["e2e_latency"] = time.monotonic() - request.created_s
    text = output_text(tokenizer, request, num_tokens, finished)
    return {"text": text, "output_ids": request.output_ids[start:num_tokens], "meta_info": meta}


async def read_json(http: web.Request, default=None):
    if not http.can_read_body:
        if default is None:
            raise BadRequest("the request needs a JSON body")
        return default
    body = await http.json()
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _sse(payload) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def stream_reply(engine, http: web.Request, request: Request) -> web.StreamResponse:
    """Run `request` and stream its `/generate` reply as SSE (see `server.py`)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(http)
    incremental = engine.config.incremental_streaming_output
    sent_tokens, sent_text = 0, ""
    async with contextlib.aclosing(engine.updates(request)) as updates:
        async for num_tokens, finished in updates:
            reply = sglang_reply(engine, request, num_tokens, finished,
                                 start=sent_tokens if incremental else 0)
            if incremental:
                full_text = reply["text"]
                reply["text"] = full_text[len(sent_text):]
                sent_tokens, sent_text = num_tokens, full_text
            await response.write(_sse(reply))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class NativeApi:
    """Handlers of SGLang's native routes."""

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, http: web.Request) -> web.StreamResponse:
        engine = self.engine
        body = await read_json(http)
        requests, batch = parse_generate(body, engine.tokenizer.encode, engine.vocab_size,
                                         engine.context_length)
        await asyncio.to_thread(engine.grammars.attach, requests)
        if not requests[0].stream:
            counts = await asyncio.gather(*(engine.run(r) for r in requests))
            replies = [sglang_reply(engine, r, n, True)
                       for r, n in zip(requests, counts, strict=True)]
            return web.json_response(replies if batch else replies[0])
        if batch:
            raise BadRequest("streaming a batch is not supported; send one request per prompt")
        return await stream_reply(engine, http, requests[0])

    async def abort_request(self, http: web.Request) -> web.Response:
        body = await read_json(http, default={})
        rid, abort_all = body.get("rid") or None, bool(body.get("abort_all"))
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        if rid is None and not abort_all:
            raise BadRequest("give the rid to abort, or abort_all: true")
        await self.engine.command(lambda: self.engine.scheduler.abort(None if abort_all else rid))
        return web.Response(status=200)

    async def pause_generation(self, http: web.Request) -> web.Response:
        body = await read_json(http, default={})
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode={mode!r} is unknown; use one of {list(PAUSE_MODES)}")
        await self.engine.command(lambda: self.engine.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, http: web.Request) -> web.Response:
        await self.engine.command(self.engine.scheduler.resume)
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def update_weights_from_disk(self, http: web.Request) -> web.Response:
        engine = self.engine
        body = await read_json(http)
        model_path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("model_path must name a model directory")
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format={body['load_format']!r} is not supported; "
                             "use safetensors")
        try:
            weights = await asyncio.to_thread(load_weights, Path(model_path), engine.model_config,
                                              engine.device, engine.dtype)
        except (WeightLoadError, FileNotFoundError, OSError) as error:
            return web.json_response({"success": False, "message": str(error),
                                      "num_paused_requests": 0}, status=400)
        if body.get("abort_all_requests"):
            await engine.command(lambda: engine.scheduler.abort(None, "Abort by weight update"))
        await engine.command(lambda: engine.scheduler.swap_weights(weights, version))
        await asyncio.to_thread(return_freed_memory)  # the old weights and the load's buffers
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message,
                                  "num_paused_requests": 0})

    async def flush_cache(self, http: web.Request) -> web.Response:
        await self.engine.command(self.engine.scheduler.flush_cache)
        return web.Response(text="Cache flushed.\n")

    async def health(self, http: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.scheduler.alive else 503)

    async def health_generate(self, http: web.Request) -> web.Response:
        """200 once a 1-token generation succeeds (or the engine is visibly busy or paused)."""
        scheduler = self.engine.scheduler
        if not scheduler.alive:
            return web.Response(status=503)
        if scheduler.running or scheduler.paused:
            return web.Response(status=200)
        params = RequestSampling(max_new_tokens=1, temperature=0.0)
        probe = Request(rid=f"HEALTH_CHECK_{time.time()}", input_ids=[0], params=params,
                        generator=make_generator(params))
        try:
            await asyncio.wait_for(self.engine.run(probe), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503)
        ok = probe.finish_reason is not None and probe.finish_reason["type"] != "abort"
        return web.Response(status=200 if ok else 503)

    async def get_server_info(self, http: web.Request) -> web.Response:
        return web.json_response(self.engine.server_info())

    async def get_load(self, http: web.Request) -> web.Response:
        load = self.engine.load()
        return web.json_response([{
            "dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_used_tokens"]}])

    async def get_model_info(self, http: web.Request) -> web.Response:
        engine = self.engine
        return web.json_response({
            "model_path": engine.model_path, "tokenizer_path": engine.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": engine.weight_version, "context_length": engine.context_length,
            "vocab_size": engine.vocab_size})

    async def get_weight_version(self, http: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})


def add_routes(app: web.Application, engine) -> None:
    api = NativeApi(engine)
    router = app.router
    router.add_post("/generate", api.generate)
    router.add_post("/abort_request", api.abort_request)
    router.add_post("/pause_generation", api.pause_generation)
    router.add_post("/continue_generation", api.continue_generation)
    router.add_post("/update_weights_from_disk", api.update_weights_from_disk)
    router.add_route("*", "/flush_cache", api.flush_cache)
    router.add_get("/health", api.health)
    router.add_get("/health_generate", api.health_generate)
    router.add_get("/get_server_info", api.get_server_info)
    router.add_get("/get_load", api.get_load)
    router.add_get("/get_model_info", api.get_model_info)
    router.add_get("/get_weight_version", api.get_weight_version)
