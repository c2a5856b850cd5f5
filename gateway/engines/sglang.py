"""The driver for SGLang's native HTTP API: a real SGLang server, or the built-in engine.

It follows the API of SGLang 0.5.23 (`python/sglang/srt/entrypoints/http_server.py` and
`managers/io_struct.py` there), with SGLang's field names: `POST /generate` (`input_ids` or
`text`, `rid`, `sampling_params`, `return_logprob`, `logprob_start_len`, `stream`; reply
`text`, `output_ids`, `meta_info`), `POST /abort_request`, `POST /pause_generation`,
`POST /continue_generation`, `POST /update_weights_from_disk`, `POST /update_weight_version`,
`POST /flush_cache`, `GET /ready`, `GET /health_generate`, `GET /server_info`,
`GET /model_info`. What SGLang 0.5.23 does that a reader of its API alone would not expect,
and what the driver does about it (each is read from the file named, and has a test in
`tests/engines/test_sglang_behaviours.py` against `tests/engines/sglang_faithful.py`):

1. Seeds. With `--enable-deterministic-inference` a request without `sampling_seed` gets
   the seed 42 (`srt/sampling/sampling_batch_info.py`), so every request carries one
   (`sglang_sampling_params`; the gateway picks and records it, `SamplingParams.for_choice`).
   Without that flag no seed tensor is built and `sampling_seed` does nothing (the same
   file): `honours_seeds()` reads `enable_deterministic_inference` from `/server_info`,
   says once in the log whether seeds replay, and the pool records it with each call.
2. Noise is keyed on (seed, absolute position) (`srt/layers/sampler.py`,
   `multinomial_with_seed`): a resume with the same seed repeats itself, so the pool gives
   each resume a seed of its own (`inflight.py`).
3. `/abort_request` aborts every request whose rid starts with the one named
   (`srt/managers/scheduler.py`, `abort_request`); the rids sent must be prefix-free
   (`protocol.GenerateRequest`, `inflight.py`).
4. and 5. A request aborted while it waits in the queue gets `_handle_abort_req`'s reply
   (`srt/managers/tokenizer_manager.py`): whole text and logprobs, `output_ids` whole or,
   with `--incremental-streaming-output`, the last ID only, and no `prompt_tokens` or
   `cached_tokens`. `sglang_replies.StreamReader` reads it as cumulative and keeps the
   stream's counts.
6. NaN and infinite logprobs are written as `null` (orjson, `srt/utils/json_response.py`):
   `EngineUnavailable`, never a `TypeError`.
7. `GET /health` generates a token (`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`, on by
   default, `srt/environ.py`) and, while the engine is paused, loads weights or runs a long
   prefill, waits up to 20 s and answers 503 (`http_server.py`, `health_generate`).
   `health()` asks `GET /ready`, which answers at once; `health_generate()` is the probe that
   generates, for whoever means it. Servers without `/ready` (older ones, the built-in
   engine) are asked `GET /health`.
8. An update with requests still running (an `in_place` pause keeps them) loads the
   weights but refuses the cache flush: 400, `success: false`, and the weight version stays
   the old one (`srt/managers/scheduler_components/weight_updater.py`,
   `tokenizer_manager.update_weights_from_disk`). The driver then retracts them (a
   paused scheduler flushes despite its queue: `scheduler.flush_cache`), flushes, sets the
   version and leaves the engine as paused as it was; what it cannot do it reports as
   `WeightsNotUpdated`, with the version the engine really reports.
9. `/get_server_info` and `/get_model_info` are deprecated (a warning per call) for
   `/server_info` and `/model_info`; the driver asks those and falls back to the old paths
   on a 404 (older servers, the built-in engine).
10. Shared KV storage (HiCache with a storage backend, `--hicache-storage-backend`, which
   `/server_info` reports; `SGLangLauncher.kv_share_dir`): a page's storage key is a hash
   chained over the token IDs, seeded only by the request's `cache_salt`
   (`mem_cache/utils.py`, `storage_namespace_seed`), and neither a weight update nor
   `/flush_cache` clears storage (`UnifiedRadixCache.reset`): a server would load KV that
   older weights computed. So the driver sends the weight version as `cache_salt` with
   every `/generate` to such a server (`kv_salt`; re-read after each weight update). A
   salt, not `POST /hicache/storage-backend/clear` after each update: with servers
   sharing one storage, a clear by one races with writes of the old version by another
   not yet updated, while a salted key is exact whatever the order (the old versions'
   files stay: one storage directory per run). Each reply says how many prompt tokens
   came from storage, `meta_info.cached_tokens_details.storage`
   (`scheduler_components/output_streamer.py`, `get_cached_tokens_details`), which the
   results carry as `storage_tokens`.

Streams are SSE (`data: {...}` events, then `data: [DONE]`). SGLang sends cumulative
`text`/`output_ids`/`output_token_logprobs` by default and deltas with
`--incremental-streaming-output`; `SGLangDriver.generate_stream` yields deltas either way
(`meta_info.completion_tokens` tells which form a chunk has).

Undertow's own extension of the built-in engine, KV transfer (the `KVTransfer` protocol:
`export_kv`, `import_kv`, `stage_kv`, `release_kv`, `generate_staged_stream`, with the
protocol's `KVPayload` and `StagedKV`; its wire is `gateway/kv_wire.py`'s;
`supports_kv_transfer()`, declared on the `EngineDriver` protocol, asks the engine), is
optional: a real SGLang server reports it unsupported, and the vLLM driver answers False
and has none of the other methods.

`transport.py` holds what it shares with the vLLM driver in `vllm.py` (requests, SSE, errors);
`sglang_replies.py` reads SGLang's replies into the protocol's results and deltas.

    async with SGLangDriver("http://127.0.0.1:30000") as engine:
        result = await engine.generate(GenerateRequest(input_ids=(1, 2, 3)))
"""

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from undertow.gateway.engines.protocol import (
    EngineError,
    EngineRejected,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    KVPayload,
    ModelInfo,
    PauseMode,
    SamplingParams,
    StagedKV,
    WeightsNotUpdated,
    random_seed,
)
from undertow.gateway.engines.sglang_replies import (
    StreamReader,
    latest_events,
    num_prompt_ids,
    read_result,
)
from undertow.gateway.engines.transport import HttpEngine, HttpTransport
from undertow.gateway.kv_wire import KV_END_HEADER, KV_START_HEADER, KV_TRANSFER

__all__ = ["HttpTransport", "KVPayload", "SGLangDriver", "StagedKV", "sglang_body",
           "sglang_body_pieces", "sglang_sampling_params"]

log = logging.getLogger(__name__)

# How SGLang 0.5.23's refused flush after a weight load begins (`weight_updater.py`).
WEIGHTS_LOADED_CACHE_KEPT = "Weights were updated, but the cache was not flushed"


def sglang_sampling_params(params: SamplingParams) -> dict[str, Any]:
    """The `sampling_params` object of SGLang's `/generate`, always with a seed (the module
    docstring, item 1)."""
    wire: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
        "ignore_eos": params.ignore_eos, "skip_special_tokens": params.skip_special_tokens,
    }
    if params.stop:
        wire["stop"] = list(params.stop)
    if params.stop_token_ids:
        wire["stop_token_ids"] = list(params.stop_token_ids)
    if params.json_schema is not None:
        wire["json_schema"] = params.json_schema
    if params.regex is not None:
        wire["regex"] = params.regex
    if params.ebnf is not None:
        wire["ebnf"] = params.ebnf
    if params.structural_tag is not None:
        wire["structural_tag"] = params.structural_tag
    wire["sampling_seed"] = (random_seed() if params.sampling_seed is None
                             else params.sampling_seed)
    return wire


def sglang_body(request: GenerateRequest, *, stream: bool,
                cache_salt: str | None = None) -> dict[str, Any]:
    """The JSON body of SGLang's `POST /generate`, to be serialised with orjson (which
    writes `input_ids_json` as it is); `cache_salt` as the module docstring, item 10, says."""
    body = _sglang_fields(request, stream, cache_salt)
    if request.input_ids_json is not None:
        body["input_ids"] = orjson.Fragment(request.input_ids_json.to_bytes())
    elif request.input_ids is not None:
        body["input_ids"] = (request.input_ids if isinstance(request.input_ids, tuple | list)
                             else list(request.input_ids))  # a JSON array; not copied
    else:
        body["text"] = request.text
    return body


def sglang_body_pieces(request: GenerateRequest, *, stream: bool,
                       cache_salt: str | None = None) -> list[bytes]:
    """`sglang_body` serialised, in pieces for a vectored write: the pieces of
    `input_ids_json` go as they are, never joined."""
    if request.input_ids_json is None:
        return [orjson.dumps(sglang_body(request, stream=stream, cache_salt=cache_salt))]
    rest = orjson.dumps(_sglang_fields(request, stream, cache_salt))  # b'{"rid":...}'
    return [b'{"input_ids":', *request.input_ids_json.pieces, b"]," + rest[1:]]


def _sglang_fields(request: GenerateRequest, stream: bool,
                   cache_salt: str | None) -> dict[str, Any]:
    """The body's fields other than the prompt."""
    body: dict[str, Any] = {"rid": request.rid,
                            "sampling_params": sglang_sampling_params(request.sampling_params),
                            "stream": stream}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if request.return_logprob:
        body["return_logprob"] = True
        body["logprob_start_len"] = -1  # logprobs of the output tokens only
    return body


class SGLangDriver(HttpEngine):
    """The `EngineDriver` protocol over SGLang's native HTTP API (SGLang 0.5.23, or the built-in
    engine), and the `KVTransfer` protocol over the built-in engine's extension of it."""

    def __init__(self, url: str, session: aiohttp.ClientSession | None = None):
        super().__init__(url, session)
        self._kv_transfer: bool | None = None
        self._pause_mode: PauseMode | None = None  # as this driver last left the engine
        self._ready_path = "/ready"
        self._missing_paths: set[str] = set()
        self._seeds_said: bool | None = None  # what the log last said of this engine's seeds
        self._kv_salt: str | None = None  # the cache_salt of every /generate (item 10)
        self._kv_salt_known = False
        self._kv_salt_lock = asyncio.Lock()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        body = sglang_body(request, stream=False, cache_salt=await self.kv_salt())
        reply = await self._http.request("POST", "/generate", body)
        return read_result(reply, request)

    def generate_stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        return self._chunks("/generate", None, request)

    async def _chunks(self, path: str, body: dict | None, request: GenerateRequest
                      ) -> AsyncGenerator[GenerateChunk, None]:
        """The deltas of a streamed `/generate`-shaped reply (`sglang_replies.StreamReader`),
        one per event less those a later event of the same read holds (`latest_events`).
        `body` None: `request`'s own, salted (module docstring, item 10)."""
        pieces = body if body is not None else sglang_body_pieces(
            request, stream=True, cache_salt=await self.kv_salt())
        reader = StreamReader(request.rid, num_prompt_ids(request))
        async for events in self._http.sse_batches(path, pieces):
            for event in latest_events(events):
                yield reader.chunk(event)

    async def abort(self, rid: str | None) -> None:
        body = {"rid": "", "abort_all": True} if rid is None else {"rid": rid}
        await self._http.request("POST", "/abort_request", body)

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._http.request("POST", "/pause_generation", {"mode": mode})
        self._pause_mode = mode

    async def resume(self) -> None:
        await self._http.request("POST", "/continue_generation", {})
        self._pause_mode = None

    async def kv_salt(self) -> str | None:
        """The `cache_salt` of this engine's requests: its weight version where it shares KV
        storage (module docstring, item 10), else None. Asked once (and again after each
        weight update); an engine that does not answer gets no salt this time."""
        if self._kv_salt_known:
            return self._kv_salt
        async with self._kv_salt_lock:
            if not self._kv_salt_known:
                try:
                    info = await self.server_info()
                    shares = isinstance(info, dict) and bool(info.get("hicache_storage_backend"))
                    self._kv_salt = (await self.model_info()).weight_version if shares else None
                except EngineError:
                    return None
                self._kv_salt_known = True
            return self._kv_salt

    async def update_weights_from_disk(self, model_path: str,
                                       weight_version: str | None = None) -> None:
        """See `EngineDriver.update_weights_from_disk` and the module docstring, items 8
        and 10."""
        try:
            await self._update_weights(model_path, weight_version)
        finally:
            self._kv_salt_known = False  # the weight version may be another now

    async def _update_weights(self, model_path: str, weight_version: str | None) -> None:
        body = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        try:
            reply = await self._http.request("POST", "/update_weights_from_disk", body)
        except EngineRejected as error:
            if not error.message.startswith(WEIGHTS_LOADED_CACHE_KEPT):
                raise WeightsNotUpdated(error.message, loaded=False, url=self.url,
                                        weight_version=await self._reported_version()
                                        ) from error
            await self._flush_after_load(weight_version)
            return
        if isinstance(reply, dict) and reply.get("success") is False:
            raise WeightsNotUpdated(str(reply.get("message")), loaded=False, url=self.url,
                                    weight_version=await self._reported_version())

    async def _flush_after_load(self, weight_version: str | None) -> None:
        """The weights are loaded but the cache was not flushed and the version not set,
        because requests were running (SGLang 0.5.23, `weight_updater.py`): retract them
        (a paused scheduler flushes despite its queue, `scheduler.flush_cache`), flush, set
        the version (without `/update_weight_version`'s default abort of every request),
        and leave the engine paused only if it was. The retracted requests recompute their
        KV with the new weights when generation continues."""
        was_paused = self._pause_mode is not None
        try:
            await self.pause("retract")
            await self.flush_cache()
            if weight_version is not None:
                await self._http.request("POST", "/update_weight_version", {
                    "new_version": weight_version, "abort_all_requests": False})
        except EngineError as error:
            raise WeightsNotUpdated(
                f"the engine loaded the new weights but could not flush its cache or set "
                f"their version ({error}); it serves them with a stale prefix cache",
                loaded=True, weight_version=await self._reported_version(), url=self.url
            ) from error
        finally:
            if not was_paused:
                await self.resume()

    async def _reported_version(self) -> str | None:
        """The weight version the engine reports now; None when it does not answer."""
        try:
            return (await self.model_info()).weight_version
        except EngineError:
            return None

    async def flush_cache(self) -> None:
        await self._http.request("POST", "/flush_cache")

    async def health(self) -> bool:
        """`GET /ready` (see the module docstring, item 7); `/health` where there is none.
        `/ready` also answers 503 while the engine is paused; an engine this driver paused
        is healthy all the same."""
        status = await self._http.status(self._ready_path)
        if status == 404 and self._ready_path != "/health":
            self._ready_path = "/health"
            status = await self._http.status(self._ready_path)
        return status == 200 or (status == 503 and self._pause_mode is not None)

    async def health_generate(self) -> bool:
        """True when the engine generates a token (SGLang's deeper health check, which
        waits up to 20 s while the engine is busy or paused)."""
        return await self._http.ok("/health_generate")

    async def _get_info(self, path: str, old_path: str) -> dict:
        """`GET path`, or `old_path` on a server without it (module docstring, item 9)."""
        if path not in self._missing_paths:
            try:
                return await self._http.request("GET", path)
            except EngineRejected as error:
                if error.status != 404:
                    raise
                self._missing_paths.add(path)
        return await self._http.request("GET", old_path)

    async def server_info(self) -> dict:
        return await self._get_info("/server_info", "/get_server_info")

    async def honours_seeds(self) -> bool | None:
        """`enable_deterministic_inference` as `/server_info` reports it (the module
        docstring, item 1); None when it is not reported. Logged once, and again when it
        changes (a server restarted with other flags)."""
        try:
            info = await self.server_info()
        except EngineError:
            return None
        value = info.get("enable_deterministic_inference") if isinstance(info, dict) else None
        honours = value if isinstance(value, bool) else None
        if honours is not None and honours != self._seeds_said:
            self._seeds_said = honours
            if honours:
                log.info("engine at %s runs with deterministic inference: a call's recorded "
                         "sampling_seed replays it", self.url)
            else:
                log.warning("engine at %s runs without --enable-deterministic-inference: it "
                            "ignores sampling_seed, so the seeds recorded with its calls replay "
                            "nothing (restart it with the flag, on an attention backend that "
                            "allows it, to replay them)", self.url)
        return honours

    async def supports_kv_transfer(self) -> bool:
        """True when the engine has Undertow's `kv_transfer` extension (the built-in engine;
        a real SGLang server has not). Asked once, then remembered; never raises."""
        if self._kv_transfer is None:
            try:
                info = await self.server_info()
            except EngineError:
                return False
            extensions = info.get("undertow_extensions") if isinstance(info, dict) else None
            self._kv_transfer = KV_TRANSFER in (extensions or ())
        return self._kv_transfer

    async def export_kv(self, *, rid: str | None = None, input_ids: list[int] | None = None,
                        start: int = 0, span_ids: bool = False, stop: bool = False) -> KVPayload:
        """Undertow extension: the KV of running request `rid` (its prompt and output so far),
        or of the longest cached prefix of `input_ids`, from position `start` on. With
        `span_ids` the payload carries the token IDs of its own span only (enough for
        `stage_kv`; `import_kv` needs them all); `stop` (with `rid`) aborts the request in
        the same step, so that the payload holds the last of its KV."""
        body: dict = {"start": start}
        if rid is not None:
            body["rid"] = rid
        else:
            body["input_ids"] = list(input_ids or ())
        if span_ids:
            body["token_ids"] = "span"
        if stop:
            body["stop"] = True
        data, headers = await self._http.post_bytes("/undertow/export_kv", body=body)
        return KVPayload(data, int(headers.get(KV_START_HEADER, start)),
                         int(headers.get(KV_END_HEADER, start)))

    async def import_kv(self, payload: KVPayload) -> int:
        """Undertow extension: put an exported payload into this engine's prefix cache;
        return how many of its sequence's tokens the cache now holds."""
        data, _ = await self._http.post_bytes("/undertow/import_kv", data=payload.data)
        return int(json.loads(data)["num_cached_tokens"])

    async def stage_kv(self, payload: KVPayload, handle: str | None = None) -> StagedKV:
        """Undertow extension: put a payload into a KV slot reserved for the request that
        will continue the sequence; without `handle` a new staging (the payload starts at
        0), with it the next span of that staging. Returns the staging as the engine holds
        it (the digest of the IDs it received)."""
        path = "/undertow/stage_kv" + (f"?handle={handle}" if handle is not None else "")
        data, _ = await self._http.post_bytes(path, data=payload.data)
        reply = json.loads(data)
        return StagedKV(str(reply["handle"]), int(reply["num_tokens"]), str(reply["digest"]))

    async def release_kv(self, handle: str) -> None:
        """Undertow extension: free a staging that no request will use."""
        await self._http.request("POST", "/undertow/release_kv", {"handle": handle})

    async def generate_staged_stream(self, request: GenerateRequest,
                                     staged: StagedKV) -> AsyncGenerator[GenerateChunk, None]:
        """Undertow extension: `generate_stream` of `request`, whose first `staged.num_tokens`
        input IDs are staged on the engine: only the IDs after them are sent, with the
        staging's handle and the digest of the prefix they continue. A 404 (no such
        staging) or 409 (it holds another prefix; it is kept) raises `EngineRejected`
        before any chunk."""
        assert request.input_ids is not None  # a staging continues token IDs (migration.py)
        suffix = replace(request, input_ids=list(request.input_ids[staged.num_tokens:]),
                         input_ids_json=None)  # the whole prompt's JSON is not needed
        body = sglang_body(suffix, stream=True)
        body["staged_kv"] = {"handle": staged.handle, "num_tokens": staged.num_tokens,
                             "digest": staged.digest}
        async for chunk in self._chunks("/undertow/generate_staged", body, request):
            yield chunk

    async def model_info(self) -> ModelInfo:
        reply = await self._get_info("/model_info", "/get_model_info")
        return ModelInfo(model_path=str(reply.get("model_path", "")),
                         weight_version=reply.get("weight_version"), raw=reply)
