"""A test server that answers as SGLang 0.5.23 does where the SGLang driver met surprises.

`FaithfulSGLang` is a real aiohttp server speaking SGLang's native API. It samples no model:
a token is a hash of the weights' name, the sampling seed, the absolute position and the
last context tokens. Each reply follows the SGLang 0.5.23 code named here (paths as in
the `sglang==0.5.23` wheel, `sglang/srt/...`):

1. Seeds (`sampling/sampling_batch_info.py`, `layers/sampler.py`): with `deterministic`
   (`--enable-deterministic-inference`) a request without `sampling_seed` gets seed 42,
   and without it the seed is ignored (a fresh random draw per token).
2. Noise keyed on (seed, absolute position) (`layers/sampler.py`, `multinomial_with_seed`):
   the same seed on the same context draws the same token, resumes included.
3. Abort by prefix (`managers/scheduler.py`, `abort_request`): every request whose rid
   starts with the one named ends. As in `managers/tokenizer_manager.py` (`abort_request`),
   with one tokenizer worker a rid the server does not know is not passed on; with
   `num_tokenizer_workers > 1` it is.
4. and 5. The reply to a request aborted while queued (`tokenizer_manager._handle_abort_req`):
   whole `text` and `output_token_logprobs`, `output_ids` whole or, with `incremental`
   (`--incremental-streaming-output`), the last ID only; no `prompt_tokens`, no
   `cached_tokens`. A running request that is aborted ends through the ordinary output
   path (`tokenizer_manager._handle_batch_output`), in the stream's form, with its counts.
6. `null_logprob_at` (fault switch): the logprob at that output position is NaN, which
   SGLang's orjson responses write as `null` (`utils/json_response.py`).
7. `/health` and `/health_generate` (`entrypoints/http_server.py`, `health_generate`):
   they generate a token unless `health_generation` is off
   (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`, `environ.py`); while paused no output
   comes, so they wait `health_check_timeout_s` (SGLang: 20 s) and answer 503. `/ready`
   answers at once: 503 while paused (`tokenizer_manager.is_ready`), else 200.
8. Weight updates (`tokenizer_manager.update_weights_from_disk`,
   `scheduler_components/weight_updater.py`, `scheduler.flush_cache`): not paused, the
   update waits for running requests (the model-update lock); paused, it loads at once,
   and the flush after it is refused while requests run (`in_place` keeps them running;
   `retract` moves them to the queue, which a paused scheduler ignores): then 400,
   `success: false`, the weights are the new ones and the reported `weight_version` the
   old one. `/update_weight_version` aborts every request unless told not to.
   `flush_refused` (fault switch) refuses every flush.
9. `/get_server_info` and `/get_model_info` are deprecated: each call is counted in
   `deprecated_calls` (SGLang logs a warning); `old_server` is an SGLang from before
   `/server_info`, `/model_info` and `/ready` (404).
10. Crashes (issue 36, seen on a real server): `/generate` validates `token_ids_logprob`
   against the model's vocabulary but not `input_ids` (`managers/tokenizer_manager.py`,
   `_validate_one_request`), so an input ID outside [0, `vocab_size`) reaches the
   embedding, whose `IndexError` takes the scheduler and the whole server down; and
   `update_weights_from_disk` of a checkpoint whose `config.json` names another
   `vocab_size` fails an assertion in the weight loader, with the same end. Either way the
   server `die`s: no HTTP reply, every open connection dropped, the port closed
   (`serve_faithful`). `die_on_update` (fault switch) dies on any weight update.
   `/server_info` reports `enable_deterministic_inference` as launched (`deterministic`;
   SGLang's own default is off, the launcher's on where the backend allows it).

11. Shared KV storage (HiCache with the `file` backend on a directory several servers see,
   `SGLangLauncher.kv_share_dir`): `kv_storage`, a dict shared by the servers, stands for
   the directory. Pages of `page_size` tokens are keyed by a hash chained over their token
   IDs, seeded by the request's `cache_salt` only (`mem_cache/utils.py`,
   `storage_namespace_seed`, `get_hash_str`; the served model name, the same on every
   server, is left out), and hold the weights that computed them. A prompt's whole pages
   are written through after its prefill, and the prompt's and output's when the request
   ends, finished or aborted (`write_through`; `batch_result_processor.py`, release with
   `checkpoint=True`). A request loads from storage the whole pages beyond its own cache's
   (page-aligned) match, when they are at least `prefetch_threshold` tokens
   (`wait_complete`: all of them), and keeps one token to compute. A weight update or
   a flush clears the server's own cache, never storage (`UnifiedRadixCache.reset`); the
   prefix cache is namespaced by the salt too (`RadixKey.cache_salt`). `cached_tokens`
   counts the storage hits too, and `cached_tokens_details` splits them: `device`,
   `host` (0 here), `storage`, `storage_backend` (`output_streamer.py`,
   `get_cached_tokens_details`; absent when nothing was cached). A request that loads
   pages other weights computed continues from wrong KV: its tokens differ from the
   right ones (`stale_kv_loads` counts those pages). `/server_info` reports
   `hicache_storage_backend` ("file", or None without storage).

`bodies` keeps every JSON body received, by path, and `replies` every `/generate` reply and
stream event sent, for tests that check both against SGLang's own types (`sglang_types.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

DEFAULT_SEED = 42  # sampling_batch_info.py
NUM_CONTEXT_IDS = 4  # how many trailing context IDs the fake "logits" depend on
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are "
                 "still running or queued. Retract or finish them, then call /flush_cache.")


@dataclass(eq=False)
class Request:
    """One generation on the server: its output so far and where it is."""

    rid: str
    input_ids: list[int]
    params: dict
    stream: bool
    return_logprob: bool
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    queued: bool = False  # in the waiting queue (retracted), not the running batch
    cache_salt: str | None = None
    stale_kv: bool = False  # continues from KV that other weights computed (item 11)
    abort_message: str | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_sent: int = 0  # output IDs already streamed (incremental form)
    cached_details: dict | None = None  # `meta_info.cached_tokens_details` (item 11)


@dataclass
class FaithfulSGLang:
    """SGLang 0.5.23 as the module docstring describes it; attributes are fault switches."""

    deterministic: bool = True
    incremental: bool = False
    health_generation: bool = True
    health_check_timeout_s: float = 3.0
    old_server: bool = False
    num_tokenizer_workers: int = 1
    null_logprob_at: int | None = None
    flush_refused: bool = False  # fault switch: every cache flush is refused
    die_on_update: bool = False  # fault switch: a weight update kills the server
    step_delay_s: float = 0.005
    vocab_size: int = 50_000
    model_path: str = "/models/a"
    weight_version: str = "0"
    requests: dict[str, Request] = field(default_factory=dict)
    paused: str | None = None
    prompts: list[list[int]] = field(default_factory=list)
    bodies: dict[str, list[dict]] = field(default_factory=dict)
    deprecated_calls: list[str] = field(default_factory=list)
    replies: list[dict] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    num_health_generations: int = 0
    updating: bool = False
    weights: str = ""
    dead: bool = False
    kv_storage: dict[str, str] | None = None  # shared storage: page key -> its weights (11)
    page_size: int = 64
    prefetch_threshold: int = 64  # as `SGLangLauncher.kv_share_dir` launches it
    prompt_salts: list[str | None] = field(default_factory=list)  # the cache_salt of each prompt
    stale_kv_loads: int = 0

    def __post_init__(self) -> None:
        self.weights = self.weights or self.model_path
        self._changed = asyncio.Condition()
        self.died = asyncio.Event()
        self._connections: set[asyncio.BaseTransport] = set()

    def die(self) -> None:
        """The server process exits (item 10): every connection drops without a reply."""
        self.dead = True
        for connection in list(self._connections):
            connection.abort()
        self.died.set()

    @web.middleware
    async def alive(self, http: web.Request, handler) -> web.StreamResponse:
        """Requests reach a live server only; each one's connection is dropped if it dies."""
        connection = http.transport
        if self.dead or connection is None:
            if connection is not None:
                connection.abort()
            return web.Response(status=503)  # never sent: the connection is gone
        self._connections.add(connection)
        try:
            return await handler(http)
        finally:
            self._connections.discard(connection)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.alive])
        routes = {"/generate": self.generate, "/abort_request": self.abort_request,
                  "/pause_generation": self.pause, "/continue_generation": self.resume,
                  "/update_weights_from_disk": self.update_weights,
                  "/update_weight_version": self.update_weight_version,
                  "/flush_cache": self.flush_cache}
        for path, handler in routes.items():
            app.router.add_post(path, handler)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/get_model_info", self.deprecated(self.model_info))
        app.router.add_get("/get_server_info", self.deprecated(self.server_info))
        if not self.old_server:
            app.router.add_get("/ready", self.ready)
            app.router.add_get("/model_info", self.model_info)
            app.router.add_get("/server_info", self.server_info)
        return app

    # -- sampling ---------------------------------------------------------------------

    def draw(self, request: Request) -> tuple[int, float]:
        """The next token: a function of (weights, seed, absolute position, context)."""
        seed = request.params.get("sampling_seed")
        if not self.deterministic:
            seed = random.getrandbits(64)  # the seed is ignored: sampling_seed is None
        elif seed is None:
            seed = DEFAULT_SEED
        context = (request.input_ids + request.output_ids)[-NUM_CONTEXT_IDS:]
        position = len(request.input_ids) + len(request.output_ids)
        weights = f"stale:{self.weights}" if request.stale_kv else self.weights
        key = f"{weights}|{seed}|{position}|{context}".encode()
        value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        logprob = -0.01 - (value >> 40) % 1000 / 100
        if self.null_logprob_at == len(request.output_ids):
            logprob = math.nan
        return value % self.vocab_size, logprob

    async def run(self, request: Request) -> None:
        """Decodes `request` step by step until it finishes or is aborted."""
        max_new = request.params.get("max_new_tokens", 128)
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: not self.paused
                                             or request.abort_message is not None)
            if request.abort_message is not None:
                return self.finish(request, {"type": "abort",
                                             "message": request.abort_message})
            token_id, logprob = self.draw(request)
            request.output_ids.append(token_id)
            request.logprobs.append(logprob)
            if len(request.output_ids) >= max_new:
                return self.finish(request, {"type": "length", "length": max_new})
            request.events.put_nowait(self.reply(request, None))
            await asyncio.sleep(self.step_delay_s)

    def finish(self, request: Request, reason: dict) -> None:
        self.write_through(request.cache_salt, request.input_ids + request.output_ids)
        request.events.put_nowait(self.reply(request, reason))
        request.events.put_nowait(None)
        self.requests.pop(request.rid, None)

    def reply(self, request: Request, reason: dict | None) -> dict:
        """An output of the ordinary path, in the stream's form (cumulative or delta)."""
        start = request.num_sent if request.stream and self.incremental else 0
        request.num_sent = len(request.output_ids)
        meta = {"id": request.rid, "finish_reason": reason,
                "prompt_tokens": len(request.input_ids),
                "completion_tokens": len(request.output_ids),
                "cached_tokens": request.cached_tokens, "weight_version": self.weight_version}
        if request.cached_tokens and request.cached_details is not None:
            meta["cached_tokens_details"] = request.cached_details
        if request.return_logprob:
            meta["output_token_logprobs"] = self.logprob_entries(request, start)
        return {"text": self.text(request.output_ids[start:]),
                "output_ids": request.output_ids[start:], "meta_info": meta}

    def queued_abort_reply(self, request: Request, message: str) -> dict:
        """`tokenizer_manager._handle_abort_req`: see the module docstring, 4 and 5."""
        meta = {"id": request.rid, "finish_reason": {"type": "abort", "message": message},
                "weight_version": self.weight_version,
                "completion_tokens": len(request.output_ids)}
        if request.return_logprob:
            meta["output_token_logprobs"] = self.logprob_entries(request, 0)
        output_ids = list(request.output_ids)
        if request.stream and self.incremental:
            output_ids = output_ids[-1:]
        return {"text": self.text(request.output_ids), "output_ids": output_ids,
                "meta_info": meta}

    def logprob_entries(self, request: Request, start: int) -> list[list]:
        return [[None if math.isnan(lp) else lp, token_id, None] for lp, token_id in
                zip(request.logprobs[start:], request.output_ids[start:], strict=True)]

    @staticmethod
    def text(token_ids: list[int]) -> str:
        return "".join(f"<{token_id}>" for token_id in token_ids)

    # -- generation -------------------------------------------------------------------

    async def generate(self, http: web.Request) -> web.StreamResponse:
        body = await self.record(http)
        rid = body["rid"]
        self.rids.append(rid)
        input_ids = (list(body["input_ids"]) if "input_ids" in body
                     else [ord(char) % self.vocab_size for char in body["text"]])  # "tokenized"
        if any(not 0 <= token_id < self.vocab_size for token_id in input_ids):
            self.die()  # the embedding's IndexError (item 10)
            return web.Response(status=500)  # never sent
        salt = body.get("cache_salt") or None  # "" is no salt (`io_struct.py`)
        request = Request(rid, input_ids, dict(body.get("sampling_params") or {}),
                          bool(body.get("stream")), bool(body.get("return_logprob")),
                          self.cached_prefix(input_ids, salt), cache_salt=salt)
        self.load_from_storage(request)
        self.prompts.append(input_ids)
        self.prompt_salts.append(salt)
        self.write_through(salt, input_ids)
        self.requests[rid] = request
        task = asyncio.create_task(self.run(request))
        try:
            if not request.stream:
                last = None
                async for event in self.events(request):
                    last = event
                return web.json_response(last)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(http)
            async for event in self.events(request):
                if self.dead:
                    return response
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if not self.dead:
                await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.requests.pop(rid, None)
            await self.notify()

    async def events(self, request: Request) -> AsyncIterator[dict]:
        while (event := await request.events.get()) is not None:
            self.replies.append(event)
            yield event

    def cached_prefix(self, input_ids: list[int], salt: str | None = None) -> int:
        """The longest prefix shared with an earlier prompt of the same salt since the last
        flush (whole pages only where the server has storage: its `page_size` is set)."""
        best = 0
        for prompt, prompt_salt in zip(self.prompts, self.prompt_salts, strict=True):
            if prompt_salt != salt:
                continue
            num = 0
            while num < min(len(prompt), len(input_ids)) and prompt[num] == input_ids[num]:
                num += 1
            best = max(best, num)
        best = min(best, len(input_ids) - 1)
        return best if self.kv_storage is None else best // self.page_size * self.page_size

    def page_keys(self, salt: str | None, token_ids: list[int]) -> list[str]:
        """The storage keys of `token_ids`' whole pages, each chained on the previous one's
        and seeded by the salt (item 11)."""
        keys, prior = [], "" if salt is None else hashlib.sha256(
            b"sglang-cache-namespace-v1" + salt.encode()).hexdigest()
        for end in range(self.page_size, len(token_ids) + 1, self.page_size):
            page = json.dumps(token_ids[end - self.page_size:end]).encode()
            prior = hashlib.sha256(prior.encode() + page).hexdigest()
            keys.append(prior)
        return keys

    def write_through(self, salt: str | None, token_ids: list[int]) -> None:
        if self.kv_storage is not None:
            for key in self.page_keys(salt, token_ids):
                self.kv_storage.setdefault(key, self.weights)

    def load_from_storage(self, request: Request) -> None:
        """The pages storage holds beyond the request's cached prefix (item 11)."""
        if self.kv_storage is None:
            return
        device = request.cached_tokens
        keys = self.page_keys(request.cache_salt, request.input_ids[:-1])  # one to compute
        stored = next((i for i, key in enumerate(keys) if key not in self.kv_storage),
                      len(keys))
        hit = max(0, stored * self.page_size - device)
        if hit < self.prefetch_threshold:
            hit = 0
        loaded = keys[device // self.page_size:(device + hit) // self.page_size]
        stale = sum(self.kv_storage[key] != self.weights for key in loaded)
        self.stale_kv_loads += stale
        request.stale_kv = stale > 0
        request.cached_tokens = device + hit
        request.cached_details = {"device": device, "host": 0, "storage": hit,
                                  "storage_backend": "HiCacheFile"}

    async def record(self, http: web.Request) -> dict:
        body = await http.json() if http.can_read_body else {}
        self.bodies.setdefault(http.path, []).append(body)
        return body

    # -- control ----------------------------------------------------------------------

    async def abort_request(self, http: web.Request) -> web.Response:
        body = await self.record(http)
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        if not abort_all and rid not in self.requests and self.num_tokenizer_workers == 1:
            return web.Response()  # tokenizer_manager.abort_request: unknown rid
        await self.abort_matching(lambda other: abort_all or other.startswith(rid),
                                  "Abort requested")
        return web.Response()

    async def abort_matching(self, matches, message: str) -> None:
        for request in list(self.requests.values()):
            if not matches(request.rid):
                continue
            if request.queued:  # aborted in the waiting queue
                request.events.put_nowait(self.queued_abort_reply(request, message))
                request.events.put_nowait(None)
                self.requests.pop(request.rid, None)
            else:
                request.abort_message = message
        await self.notify()

    async def pause(self, http: web.Request) -> web.Response:
        mode = (await self.record(http)).get("mode", "abort")
        self.paused = mode
        if mode == "abort":
            await self.abort_matching(lambda rid: True, "Abort by pause")
        elif mode == "retract":
            for request in self.requests.values():
                request.queued = True
        return web.json_response({"message": "Generation paused successfully.",
                                   "status": "ok"})

    async def resume(self, http: web.Request) -> web.Response:
        await self.record(http)
        self.paused = None
        for request in self.requests.values():
            request.queued = False
        await self.notify()
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def idle(self) -> bool:
        """`scheduler.is_fully_idle(ignore_waiting=paused)`, where a flush may run."""
        return not self.flush_refused and not any(
            self.paused is None or not r.queued for r in self.requests.values())

    async def update_weights(self, http: web.Request) -> web.Response:
        body = await self.record(http)
        if self.paused is None:  # the model-update lock waits for running requests
            self.updating = True
            try:
                async with self._changed:
                    await self._changed.wait_for(lambda: not self.requests)
            finally:
                self.updating = False
        if self.die_on_update or self.other_vocabulary(body["model_path"]):
            self.die()  # the weight loader's AssertionError (item 10)
            return web.Response(status=500)  # never sent
        self.weights = self.model_path = body["model_path"]
        if not self.idle():
            return web.json_response({"success": False, "message": FLUSH_REFUSED,
                                      "num_paused_requests": 0}, status=400)
        self.prompts.clear()
        self.prompt_salts.clear()
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": "Succeeded to update model weights."})

    def other_vocabulary(self, model_path: str) -> bool:
        """Whether `model_path` is a model directory of another vocabulary than the served
        one (the fake's other paths name no directory and load as they are)."""
        config = Path(model_path) / "config.json"
        return config.is_file() and json.loads(config.read_text()).get(
            "vocab_size", self.vocab_size) != self.vocab_size

    async def update_weight_version(self, http: web.Request) -> web.Response:
        body = await self.record(http)
        if body.get("abort_all_requests", True):
            await self.abort_matching(lambda rid: True, "Abort by weight version update")
        self.weight_version = body["new_version"]
        return web.json_response({"success": True, "new_version": self.weight_version})

    async def flush_cache(self, http: web.Request) -> web.Response:
        await self.record(http)
        if not self.idle():
            return web.Response(status=400, text="Flush cache failed.\n")
        self.prompts.clear()
        self.prompt_salts.clear()
        return web.Response(text="Cache flushed.\n")

    # -- probes and information -------------------------------------------------------

    async def ready(self, http: web.Request) -> web.Response:
        return web.Response(status=503 if self.paused else 200)

    async def health(self, http: web.Request) -> web.Response:
        if not self.health_generation and http.path == "/health":
            return web.Response()
        self.num_health_generations += 1
        if self.paused or self.updating:  # no output comes: HEALTH_CHECK_TIMEOUT, then 503
            await asyncio.sleep(self.health_check_timeout_s)
            return web.Response(status=503)
        return web.Response()

    def deprecated(self, handler):
        async def answer(http: web.Request) -> web.Response:
            self.deprecated_calls.append(http.path)
            return await handler(http)
        return answer

    async def model_info(self, http: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path,
                                  "weight_version": self.weight_version,
                                  "is_generation": True})

    async def server_info(self, http: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23", "internal_states": [{}],
                                  "enable_deterministic_inference": self.deterministic,
                                  "incremental_streaming_output": self.incremental,
                                  "hicache_storage_backend": (
                                      None if self.kv_storage is None else "file")})


@contextlib.asynccontextmanager
async def serve_faithful(server: FaithfulSGLang) -> AsyncIterator[str]:
    """Serves `server` on a free port of 127.0.0.1; yields its base URL."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)

    async def close_when_dead() -> None:
        await server.died.wait()
        await site.stop()  # the port is closed: connections are refused

    watcher = asyncio.create_task(close_when_dead())
    try:
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await runner.cleanup()
