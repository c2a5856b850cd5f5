"""Undertow extension of the built-in engine: export and import a sequence's KV.

Not part of SGLang's API: these routes live under `/undertow/` and `GET /get_server_info`
lists them in `undertow_extensions` ("kv_transfer"), which is how a driver finds out that an
engine has them. The gateway's pool uses them to migrate a live session between engines
without re-prefilling its history (`gateway/migration.py`):

- `POST /undertow/export_kv` `{"rid": str}` (a running request: the KV of its prompt and output
  so far, i.e. its first `kv_length` positions) or `{"input_ids": [...]}` (the longest cached
  prefix of those tokens), with `"start": n` to send only positions n.. (a later stage of a
  staged copy). Reply: the payload (below), with headers `X-Undertow-KV-Start` and
  `X-Undertow-KV-End` (the token span it covers). 404 when the rid is not running, 409 when
  fewer than `start` tokens are there.
- `POST /undertow/import_kv`, body = a payload: its KV goes into the prefix cache, so that the
  next `/generate` of those tokens reports them in `cached_tokens` and prefills only the rest.
  A payload with `start` > 0 extends a prefix imported before (409 if that is not cached).
  Reply `{"start", "end", "num_cached_tokens"}` (how many of its tokens are cached now).
  400 with a message saying what differs when the payload is not from an engine serving the
  same weights (model fingerprint, weight version), or its shapes or dtype do not fit.

Payload: safetensors bytes with tensors `kv` (float32, (layers, 2, kv_heads, end - start,
head_dim)) and `token_ids` (int64, (end,), the whole sequence from position 0), and string
metadata `format`, `model_fingerprint`, `weight_version`, `start`.

Copying happens on the scheduler's worker thread between two steps (a running request keeps
decoding before and after); encoding and decoding the bytes run off it.
"""

import asyncio
import hashlib
import json
import struct

import torch
from aiohttp import web
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from undertow.gateway.engines.builtin.errors import BadRequest

FORMAT = "undertow-kv/1"
EXPORT_PATH = "/undertow/export_kv"
IMPORT_PATH = "/undertow/import_kv"
EXTENSION = "kv_transfer"


class TransferConflict(Exception):
    """The KV asked for is not where the request assumes it is (HTTP `status`)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def model_fingerprint(weights) -> str:
    """A short digest of a few weight tensors: equal for engines serving the same weights,
    different (with overwhelming probability) for other weights of the same shapes."""
    digest = hashlib.sha256()
    for tensor in (weights.norm, weights.embed[:4], weights.layers[0].qkv[:4],
                   weights.layers[-1].down[:4], weights.lm_head[-4:]):
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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
    """Handlers of the two routes (see module doc)."""

    def __init__(self, engine):
        self.engine = engine
        self._fingerprints: dict[int, str] = {}

    @property
    def scheduler(self):
        return self.engine.scheduler

    def fingerprint(self) -> str:
        weights = self.scheduler.model.weights
        if id(weights) not in self._fingerprints:
            self._fingerprints = {id(weights): model_fingerprint(weights)}
        return self._fingerprints[id(weights)]

    async def export_kv(self, http: web.Request) -> web.Response:
        body = await http.json()
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        rid, input_ids, start = body.get("rid"), body.get("input_ids"), body.get("start", 0)
        if (rid is None) == (input_ids is None):
            raise BadRequest("give exactly one of rid (a running request) and input_ids")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise BadRequest(f"start={start!r} must be an integer >= 0")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        if input_ids is not None and not (isinstance(input_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in input_ids)):
            raise BadRequest("input_ids must be a list of token IDs")
        try:
            token_ids, kv, fingerprint, version = await self.engine.command(
                lambda: self._snapshot(rid, input_ids, start))
        except TransferConflict as error:
            return _error(str(error), error.status)
        payload = await asyncio.to_thread(save_tensors, {
            "kv": kv, "token_ids": torch.tensor(token_ids, dtype=torch.int64)}, {
            "format": FORMAT, "model_fingerprint": fingerprint, "weight_version": version,
            "start": str(start)})
        return web.Response(body=payload, content_type="application/octet-stream", headers={
            "X-Undertow-KV-Start": str(start), "X-Undertow-KV-End": str(len(token_ids))})

    def _snapshot(self, rid, input_ids, start: int) -> tuple[list[int], torch.Tensor, str, str]:
        """On the worker: the token IDs [0, end) and a copy of the KV of [start, end)."""
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
            token_ids = request.all_ids[:request.kv_length]
            self._check_start(start, len(token_ids))
            kv = scheduler.kv.read(slot, start, len(token_ids))
        else:
            match = scheduler.cache.match(input_ids, len(input_ids))
            token_ids = input_ids[:match.length]
            self._check_start(start, len(token_ids))
            spans = [kv for _, kv in scheduler.cache.spans(match, start)]
            kv = torch.cat(spans, 3) if spans else self._empty_kv()
        return token_ids, kv.contiguous(), self.fingerprint(), scheduler.weight_version

    @staticmethod
    def _check_start(start: int, end: int) -> None:
        if start > end:
            raise TransferConflict(f"only {end} tokens of KV are here, fewer than start={start}")

    def _empty_kv(self) -> torch.Tensor:
        c = self.engine.model_config
        return torch.zeros(c.num_layers, 2, c.num_kv_heads, 0, c.head_dim)

    async def import_kv(self, http: web.Request) -> web.Response:
        data = await http.read()
        metadata = _metadata(data)
        if metadata.get("format") != FORMAT:
            raise BadRequest(f"the payload's format is {metadata.get('format')!r}; this engine "
                             f"imports {FORMAT!r} (export it with {EXPORT_PATH})")
        try:
            tensors = await asyncio.to_thread(load_tensors, data)
            start = int(metadata.get("start", "0"))
        except Exception as error:  # safetensors raises its own error types
            raise BadRequest(f"the KV payload cannot be read: {error}") from None
        kv, token_ids = tensors.get("kv"), tensors.get("token_ids")
        if kv is None or token_ids is None:
            raise BadRequest("the KV payload must hold the tensors 'kv' and 'token_ids'")
        token_ids = self._check_payload(kv, token_ids, start)
        try:
            num_cached = await self.engine.command(
                lambda: self._insert(metadata, token_ids, kv, start))
        except TransferConflict as error:
            return _error(str(error), error.status)
        return web.json_response({"start": start, "end": len(token_ids),
                                  "num_cached_tokens": num_cached})

    def _check_payload(self, kv: torch.Tensor, token_ids: torch.Tensor, start: int) -> list[int]:
        c = self.engine.model_config
        if kv.dtype != torch.float32:
            raise BadRequest(f"the payload's KV has dtype {kv.dtype}; this engine keeps float32 "
                             "KV (export it from a built-in engine)")
        if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
            raise BadRequest("the payload's token_ids must be a 1-D int64 tensor")
        ids = token_ids.tolist()
        expected = (c.num_layers, 2, c.num_kv_heads, len(ids) - start, c.head_dim)
        if not 0 <= start <= len(ids) or tuple(kv.shape) != expected:
            raise BadRequest(f"the payload's KV has shape {tuple(kv.shape)} for tokens "
                             f"[{start}, {len(ids)}); this model's KV for them has shape "
                             f"{expected} (layers, 2, kv_heads, tokens, head_dim)")
        if any(not 0 <= t < c.vocab_size for t in ids):
            raise BadRequest(f"the payload's token_ids are not all in [0, {c.vocab_size})")
        if len(ids) >= self.engine.context_length:
            raise BadRequest(f"the payload holds {len(ids)} tokens; this engine's context "
                             f"length is {self.engine.context_length}")
        return ids

    def _insert(self, metadata: dict, token_ids: list[int], kv: torch.Tensor, start: int) -> int:
        """On the worker: check that the KV is this model's, then cache it."""
        scheduler, cache = self.scheduler, self.scheduler.cache
        if metadata.get("model_fingerprint") != self.fingerprint():
            raise TransferConflict(
                f"the payload's KV comes from other weights (model fingerprint "
                f"{metadata.get('model_fingerprint')!r}; this engine's is {self.fingerprint()!r});"
                " import KV only between engines serving the same model and weights", status=400)
        if metadata.get("weight_version") != scheduler.weight_version:
            raise TransferConflict(
                f"the payload's KV is of weight version {metadata.get('weight_version')!r}; this "
                f"engine serves {scheduler.weight_version!r}; update both engines to the same "
                "weights first", status=400)
        if start and cache.match(token_ids, start).length < start:
            raise TransferConflict(f"this engine does not cache the first {start} tokens this "
                                   "payload extends; import the earlier stage first (or again)")
        if len(token_ids) > start:
            cache.insert(token_ids, lambda begin, end: kv[:, :, :, begin - start:end - start])
        return cache.match(token_ids, len(token_ids)).length


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "param": None, "code": status}}, status=status)


def add_routes(app: web.Application, engine) -> None:
    api = KVTransferApi(engine)
    app.router.add_post(EXPORT_PATH, api.export_kv)
    app.router.add_post(IMPORT_PATH, api.import_kv)
