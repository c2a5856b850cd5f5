"""Undertow's KV-transfer extension of the built-in engine: the `/undertow/` routes that export
a sequence's KV, import it into the prefix cache, stage it for the request that continues it
and generate from a staging. The routes, their replies and the payload's format are in
docs/engines.md, "KV transfer"; the names the SGLang driver shares, in `gateway/kv_wire.py`.
Copying runs on the scheduler's worker thread between two steps; encoding and decoding the
bytes run off it.
"""

import asyncio
import json
import struct

import torch
from aiohttp import web
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from undertow.gateway.builtin_engine.errors import BadRequest, BuiltinEngineError
from undertow.gateway.builtin_engine.native_api import read_json, sglang_reply, stream_reply
from undertow.gateway.builtin_engine.request import Request, parse_generate
from undertow.gateway.builtin_engine.staging import StagingConflict
from undertow.gateway.kv_wire import KV_END_HEADER, KV_START_HEADER

FORMAT = "undertow-kv/1"
EXPORT_PATH = "/undertow/export_kv"
IMPORT_PATH = "/undertow/import_kv"
STAGE_PATH = "/undertow/stage_kv"
RELEASE_PATH = "/undertow/release_kv"
GENERATE_STAGED_PATH = "/undertow/generate_staged"
ID_SPANS = ("all", "span")
POSITION_MARGIN = 1024  # rotary positions prepared past a staging, for the resume's decoding
# Freeing a long context's KV takes milliseconds and holds the GIL; after a stop it waits this
# long, so that it delays neither the last payload nor the end of the stopped request's stream.
RELEASE_DELAY_S = 1.0


class TransferConflict(BuiltinEngineError):
    """The KV asked for is not where the request assumes it is (HTTP `status`)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def _metadata(data: bytes) -> dict:
    """The `__metadata__` of safetensors bytes (read by hand: `load` does not return it)."""
    if len(data) < 8:
        raise BadRequest("the body is not an Undertow KV payload (safetensors bytes from "
                         f"{EXPORT_PATH}); it is {len(data)} bytes long")
    (size,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + size])
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not an Undertow KV payload (safetensors bytes from "
                         f"{EXPORT_PATH}): {error}") from None
    return header.get("__metadata__") or {} if isinstance(header, dict) else {}


class KVTransferApi:
    """Handlers of the routes (docs/engines.md, "KV transfer")."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def scheduler(self):
        return self.engine.scheduler

    def fingerprint(self) -> str:
        return self.scheduler.model.weights.fingerprint

    async def export_kv(self, http: web.Request) -> web.StreamResponse:
        body = await read_json(http)
        rid, input_ids, start = body.get("rid"), body.get("input_ids"), body.get("start", 0)
        ids_span, stop = body.get("token_ids", "all"), body.get("stop", False)
        if (rid is None) == (input_ids is None):
            raise BadRequest("give exactly one of rid (a running request) and input_ids")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise BadRequest(f"start={start!r} must be an integer >= 0")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        if input_ids is not None and not (isinstance(input_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in input_ids)):
            raise BadRequest("input_ids must be a list of token IDs")
        if ids_span not in ID_SPANS:
            raise BadRequest(f"token_ids={ids_span!r} must be one of {list(ID_SPANS)}")
        if stop is not False and (stop is not True or rid is None):
            raise BadRequest("stop must be true or false, and only with a rid")
        ids_start = start if ids_span == "span" else 0
        try:
            token_ids, kv, fingerprint, version = await self.engine.command(
                lambda: self._snapshot(rid, input_ids, start, ids_start, stop))
        except TransferConflict as error:
            return _error(str(error), error.status)
        end = ids_start + len(token_ids)
        payload = await asyncio.to_thread(save_tensors, {
            "kv": kv, "token_ids": torch.tensor(token_ids, dtype=torch.int64)}, {
            "format": FORMAT, "model_fingerprint": fingerprint, "weight_version": version,
            "start": str(start), "token_ids_start": str(ids_start)})
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(len(payload)),
            KV_START_HEADER: str(start), KV_END_HEADER: str(end)})
        await response.prepare(http)
        await response.write(payload)
        await response.write_eof()
        if stop:  # free its memory once the gateway has read its KV and its stream's end
            asyncio.get_running_loop().call_later(
                RELEASE_DELAY_S, self.scheduler.call, self.scheduler.release_idle)
        return response

    def _snapshot(self, rid, input_ids, start: int, ids_start: int, stop: bool
                  ) -> tuple[list[int], torch.Tensor, str, str]:
        """On the worker: the token IDs [ids_start, end) and a copy of the KV of [start, end);
        with `stop`, the request is aborted right after (its KV is not cached here)."""
        scheduler = self.scheduler
        if rid is not None:
            slot = next((i for i, r in enumerate(scheduler.running) if r.rid == rid), None)
            if slot is None:
                raise TransferConflict(f"no running request {rid!r}; it may have finished, or "
                                       "not started yet", status=404)
            request = scheduler.running[slot]
            if request.epoch != scheduler.epoch:
                raise TransferConflict(f"request {rid!r} began before a weight update; its KV "
                                       "mixes weight versions and is not exported")
            end = request.kv_length
            self._check_start(start, end)
            token_ids = _id_span(request, ids_start, end)
            kv = scheduler.kv.read(slot, start, end)
            if stop:
                scheduler.stop_migrated(request)
        else:
            match = scheduler.cache.match(input_ids, len(input_ids))
            self._check_start(start, match.length)
            token_ids = input_ids[ids_start:match.length]
            spans = [kv for _, kv in scheduler.cache.spans(match, start)]
            kv = torch.cat(spans, 3) if spans else self._empty_kv()
        # The payload is float32 on the CPU whatever this engine keeps (bf16 on CUDA).
        kv = kv.to("cpu", torch.float32).contiguous()
        return token_ids, kv, self.fingerprint(), scheduler.weight_version

    @staticmethod
    def _check_start(start: int, end: int) -> None:
        if start > end:
            raise TransferConflict(f"only {end} tokens of KV are here, fewer than start={start}")

    def _empty_kv(self) -> torch.Tensor:
        c = self.engine.model_config
        return torch.zeros(c.num_layers, 2, c.num_kv_heads, 0, c.head_dim)

    async def _read_payload(self, http: web.Request) -> tuple[dict, list[int], torch.Tensor, int]:
        """A payload's metadata, token IDs, KV and start (BadRequest when it does not fit)."""
        data = await http.read()
        metadata = _metadata(data)
        if metadata.get("format") != FORMAT:
            raise BadRequest(f"the payload's format is {metadata.get('format')!r}; this engine "
                             f"imports {FORMAT!r} (export it with {EXPORT_PATH})")
        try:
            tensors = await asyncio.to_thread(load_tensors, data)
            start = int(metadata.get("start", "0"))
            ids_start = int(metadata.get("token_ids_start", "0"))
        except Exception as error:  # safetensors raises its own error types
            raise BadRequest(f"the KV payload cannot be read: {error}") from None
        kv, token_ids = tensors.get("kv"), tensors.get("token_ids")
        if kv is None or token_ids is None:
            raise BadRequest("the KV payload must hold the tensors 'kv' and 'token_ids'")
        if ids_start not in (0, start):
            raise BadRequest(f"the payload's token_ids_start={ids_start} must be 0 or its "
                             f"start={start}")
        token_ids = self._check_payload(kv, token_ids, start, ids_start)
        model = self.scheduler.model
        return metadata, token_ids, kv.to(model.device, model.dtype), start

    async def import_kv(self, http: web.Request) -> web.Response:
        metadata, token_ids, kv, start = await self._read_payload(http)
        if start and len(token_ids) < start + kv.shape[3]:
            raise BadRequest("importing into the cache needs the payload's token IDs from "
                             "position 0; export it with token_ids \"all\"")
        try:
            num_cached = await self.engine.command(
                lambda: self._insert(metadata, token_ids, kv, start))
        except TransferConflict as error:
            return _error(str(error), error.status)
        return web.json_response({"start": start, "end": len(token_ids),
                                  "num_cached_tokens": num_cached})

    def _check_payload(self, kv: torch.Tensor, token_ids: torch.Tensor, start: int,
                       ids_start: int) -> list[int]:
        c = self.engine.model_config
        if kv.dtype != torch.float32:
            raise BadRequest(f"the payload's KV has dtype {kv.dtype}; this engine keeps float32 "
                             "KV (export it from a built-in engine)")
        if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
            raise BadRequest("the payload's token_ids must be a 1-D int64 tensor")
        ids = token_ids.tolist()
        end = ids_start + len(ids)
        expected = (c.num_layers, 2, c.num_kv_heads, end - start, c.head_dim)
        if not 0 <= start <= end or tuple(kv.shape) != expected:
            raise BadRequest(f"the payload's KV has shape {tuple(kv.shape)} for tokens "
                             f"[{start}, {end}); this model's KV for them has shape "
                             f"{expected} (layers, 2, kv_heads, tokens, head_dim)")
        if any(not 0 <= t < c.vocab_size for t in ids):
            raise BadRequest(f"the payload's token_ids are not all in [0, {c.vocab_size})")
        if end >= self.engine.context_length:
            raise BadRequest(f"the payload holds {end} tokens; this engine's context "
                             f"length is {self.engine.context_length}")
        return ids

    def _check_weights(self, metadata: dict) -> None:
        """On the worker: TransferConflict (400) unless the KV is of this engine's weights."""
        if metadata.get("model_fingerprint") != self.fingerprint():
            raise TransferConflict(
                f"the payload's KV comes from other weights (model fingerprint "
                f"{metadata.get('model_fingerprint')!r}; this engine's is {self.fingerprint()!r});"
                " import KV only between engines serving the same model and weights", status=400)
        if metadata.get("weight_version") != self.scheduler.weight_version:
            raise TransferConflict(
                f"the payload's KV is of weight version {metadata.get('weight_version')!r}; this "
                f"engine serves {self.scheduler.weight_version!r}; update both engines to the "
                "same weights first", status=400)

    def _insert(self, metadata: dict, token_ids: list[int], kv: torch.Tensor, start: int) -> int:
        """On the worker: check that the KV is this model's, then cache it."""
        cache = self.scheduler.cache
        self._check_weights(metadata)
        if start and cache.match(token_ids, start).length < start:
            raise TransferConflict(f"this engine does not cache the first {start} tokens this "
                                   "payload extends; import the earlier stage first (or again)")
        if len(token_ids) > start:
            cache.insert(token_ids, lambda begin, end: kv[:, :, :, begin - start:end - start])
        return cache.match(token_ids, len(token_ids)).length

    async def stage_kv(self, http: web.Request) -> web.Response:
        handle = http.query.get("handle")
        metadata, token_ids, kv, start = await self._read_payload(http)
        span = token_ids[len(token_ids) - kv.shape[3]:]  # the IDs of [start, end)

        def stage():
            self._check_weights(metadata)
            scheduler = self.scheduler
            entry = scheduler.staged.stage(handle, start, span, kv, len(scheduler.running))
            scheduler.model.reserve_positions(entry.num_tokens + POSITION_MARGIN)
            return entry

        try:
            entry = await self.engine.command(stage)
            reply = {"handle": entry.handle, "start": start, "end": start + len(span),
                     "num_tokens": start + len(span), "digest": entry.digest.hexdigest()}
        except (TransferConflict, StagingConflict) as error:
            return _error(str(error), error.status)
        return web.json_response(reply)

    async def release_kv(self, http: web.Request) -> web.Response:
        handle = (await read_json(http)).get("handle")
        if not isinstance(handle, str):
            raise BadRequest("handle must name a staging (from stage_kv)")
        try:
            await self.engine.command(
                lambda: self.scheduler.staged.release(handle, len(self.scheduler.running)))
        except StagingConflict as error:
            return _error(str(error), error.status)
        return web.json_response({"handle": handle, "released": True})

    async def generate_staged(self, http: web.Request) -> web.StreamResponse:
        engine, body = self.engine, await read_json(http)
        handle, num_tokens, digest = _staged_fields(body.pop("staged_kv", None))
        (request,), _ = parse_generate(body, engine.tokenizer.encode, engine.vocab_size,
                                       engine.context_length)
        if request.wants_input_logprobs:
            raise BadRequest("input logprobs need the whole prompt prefilled; send it to "
                             "/generate instead")
        try:
            staged_ids = self.scheduler.staged.claim(handle, num_tokens, digest)
        except StagingConflict as error:
            return _error(str(error), error.status)
        request.staged_handle = handle
        request.input_ids = staged_ids + request.input_ids
        request.cached_tokens = num_tokens
        total = len(request.input_ids) + request.params.max_new_tokens
        if total > engine.context_length:
            self.scheduler.staged.unclaim(handle)
            raise BadRequest(f"the staged prefix, input_ids and max_new_tokens make {total} "
                             f"tokens; the context length is {engine.context_length}")
        if request.stream:
            return await stream_reply(engine, http, request)
        num_tokens = await engine.run(request)
        return web.json_response(sglang_reply(engine, request, num_tokens, True))


def _id_span(request: Request, begin: int, end: int) -> list[int]:
    """The token IDs of positions [begin, end) of a request's prompt + output, without
    building the whole sequence."""
    num_input = len(request.input_ids)
    return (request.input_ids[begin:min(end, num_input)]
            + request.output_ids[max(begin - num_input, 0):max(end - num_input, 0)])


def _staged_fields(value) -> tuple[str, int, str]:
    if not (isinstance(value, dict) and isinstance(value.get("handle"), str)
            and isinstance(value.get("num_tokens"), int) and not isinstance(
                value.get("num_tokens"), bool) and isinstance(value.get("digest"), str)):
        raise BadRequest('staged_kv must be {"handle": str, "num_tokens": int, "digest": str} '
                         f"(from {STAGE_PATH})")
    return value["handle"], value["num_tokens"], value["digest"]


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "param": None, "code": status}}, status=status)


def add_routes(app: web.Application, engine) -> None:
    api = KVTransferApi(engine)
    app.router.add_post(EXPORT_PATH, api.export_kv)
    app.router.add_post(IMPORT_PATH, api.import_kv)
    app.router.add_post(STAGE_PATH, api.stage_kv)
    app.router.add_post(RELEASE_PATH, api.release_kv)
    app.router.add_post(GENERATE_STAGED_PATH, api.generate_staged)
