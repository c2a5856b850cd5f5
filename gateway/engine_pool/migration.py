"""KV migration: move an in-flight generation to another engine with its KV, not re-prefilled.

When the pool drains an engine with `migrate`, each in-flight generation resumes elsewhere
from prompt + partial output (`inflight.py`). Where both engines have Undertow's KV transfer
(`KVTransfer`; the built-in engine has it), `migrate_attempt` copies the KV in stages while
the source keeps decoding, so the pause no longer grows with the context; the steps, and why
the tree stays exact whichever way a copy ends, are in docs/engines.md, "Migration".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from undertow.gateway.engine_pool.fleet import Attempt, EngineRecord
from undertow.gateway.engines.protocol import (
    EngineError,
    EngineRejected,
    GenerateChunk,
    GenerateRequest,
    KVTransfer,
    StagedKV,
    kv_transfer_of,
)
from undertow.gateway.kv_wire import PrefixDigest

log = logging.getLogger(__name__)

INTERRUPT_CAUSE = "migrate"  # the pool's word for an attempt it aborts to migrate
RELEASE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class MigrationConfig:
    """`kv_transfer` off makes every migration a plain re-prefill."""

    kv_transfer: bool = True
    max_delta_tokens: int = 32
    max_stages: int = 4


@dataclass(frozen=True)
class StagedResume:
    """Where the next attempt of a migrated generation finds its history's KV: `kv` (with
    the gateway's own digest of its prefix) staged on `engine`, whose driver's KV transfer
    is `transfer`."""

    engine: EngineRecord
    transfer: KVTransfer
    kv: StagedKV


@dataclass(frozen=True)
class KVCopy:
    """The two ends of one KV copy, each engine with its driver as a `KVTransfer`."""

    source: EngineRecord
    target: EngineRecord
    source_kv: KVTransfer
    target_kv: KVTransfer


async def migrate_attempt(attempt: Attempt, target: EngineRecord | None, config: MigrationConfig,
                          interrupt: Callable[[list[Attempt]], Awaitable[None]]) -> int:
    """Move `attempt` to `target` as docs/engines.md ("Migration") says; `interrupt` aborts
    it on its engine and returns once it has ended. Returns the number of tokens whose KV
    waits staged on the target for the resume (0 when it was not copied)."""
    copy = await _kv_copy(attempt.engine, target, config)
    if copy is None:
        await interrupt([attempt])
        return 0
    attempt.handover = asyncio.Event()
    digest = PrefixDigest()
    staged: StagedKV | None = None
    try:
        staged = await _stage_while_running(attempt, copy, config, digest)
        return await _cut_over(attempt, copy, staged, digest, interrupt)
    except EngineError as error:
        log.warning("KV copy of %s to %s failed (%s); it resumes by re-prefill",
                    attempt.rid, copy.target.engine_id, error)
        attempt.staged = None
        await interrupt([attempt])
        if staged is not None:
            await _release_quietly(copy.target_kv, staged.handle)
        return 0
    finally:
        attempt.handover.set()


async def _kv_copy(source: EngineRecord, target: EngineRecord | None,
                   config: MigrationConfig) -> KVCopy | None:
    """The ends of a KV copy from `source` to `target`; None when there is no target, the
    config turns KV transfer off, or either engine lacks it (the target is asked only when
    the source has it)."""
    if not config.kv_transfer or target is None:
        return None
    source_kv = await kv_transfer_of(source.driver)
    target_kv = await kv_transfer_of(target.driver) if source_kv is not None else None
    if source_kv is None or target_kv is None:
        return None
    return KVCopy(source, target, source_kv, target_kv)


async def _stage_while_running(attempt: Attempt, copy: KVCopy, config: MigrationConfig,
                               digest: PrefixDigest) -> StagedKV:
    """Stages of the copy while the source decodes; returns the staging so far."""
    staged: StagedKV | None = None
    for _ in range(config.max_stages):
        start = 0 if staged is None else staged.num_tokens
        payload = await copy.source_kv.export_kv(rid=attempt.rid, start=start, span_ids=True)
        staged = await copy.target_kv.stage_kv(payload,
                                               None if staged is None else staged.handle)
        _digest_known(attempt, digest, staged.num_tokens)
        if payload.end - start <= config.max_delta_tokens:
            break
    assert staged is not None  # max_stages >= 1
    return staged


async def _cut_over(attempt: Attempt, copy: KVCopy, staged: StagedKV, digest: PrefixDigest,
                    interrupt: Callable[[list[Attempt]], Awaitable[None]]) -> int:
    """Stop on the source with the last delta, stage it, and leave the staging to the resume."""
    attempt.interrupted_by = INTERRUPT_CAUSE  # before the stop: its abort is to be resumed
    started = time.perf_counter()
    payload = await copy.source_kv.export_kv(rid=attempt.rid, start=staged.num_tokens,
                                             span_ids=True, stop=True)
    stopped = time.perf_counter()
    staged, _ = await asyncio.gather(copy.target_kv.stage_kv(payload, staged.handle),
                                     interrupt([attempt]))
    _digest_known(attempt, digest, staged.num_tokens)  # the attempt has ended: all IDs known
    if digest.num_tokens != staged.num_tokens:
        raise EngineRejected(f"the source staged {staged.num_tokens} tokens, the gateway knows "
                             f"{digest.num_tokens} of them")
    attempt.staged = StagedResume(copy.target, copy.target_kv, StagedKV(
        staged.handle, staged.num_tokens, digest.hexdigest()))
    log.info("moved %s from %s to %s with %d tokens of KV (last delta: %d; stop %.1f ms, "
             "stage %.1f ms)", attempt.rid, copy.source.engine_id, copy.target.engine_id,
             staged.num_tokens, payload.end - payload.start, 1000 * (stopped - started),
             1000 * (time.perf_counter() - stopped))
    return staged.num_tokens


def _digest_known(attempt: Attempt, digest: PrefixDigest, end: int) -> None:
    """Feed `digest` the gateway's own record of the attempt's IDs, up to position `end` or
    as far as it has received them (the rest follows at the next call)."""
    prompt, output = attempt.token_ids, attempt.output_ids
    if digest.num_tokens < len(prompt):
        digest.update(prompt[digest.num_tokens:min(end, len(prompt))])
    if digest.num_tokens >= len(prompt):
        digest.update(output[digest.num_tokens - len(prompt):max(end - len(prompt), 0)])


def resume_stream(engine: EngineRecord, request: GenerateRequest,
                  staged: StagedResume | None) -> AsyncGenerator[GenerateChunk, None]:
    """The engine's stream for an attempt: from the staged KV when a migration staged the
    history on this engine, else (or when the engine refuses the staging) a plain one."""
    if (staged is None or staged.engine is not engine or request.input_ids is None
            or len(request.input_ids) <= staged.kv.num_tokens):
        return engine.driver.generate_stream(request)
    return _staged_stream(engine, request, staged)


async def _staged_stream(engine: EngineRecord, request: GenerateRequest,
                         staged: StagedResume) -> AsyncGenerator[GenerateChunk, None]:
    refused: EngineRejected | None = None
    pieces = staged.transfer.generate_staged_stream(request, staged.kv)
    async with contextlib.aclosing(pieces):
        try:
            async for piece in pieces:
                yield piece
            return
        except EngineRejected as error:
            if error.status not in (404, 409):
                raise
            refused = error
    log.warning("%s refused the staged KV of %s (%s); it re-prefills", engine.engine_id,
                request.rid, refused.message)
    await _release_quietly(staged.transfer, staged.kv.handle)
    async for piece in engine.driver.generate_stream(request):
        yield piece


async def _release_quietly(transfer: KVTransfer, handle: str) -> None:
    with contextlib.suppress(EngineError, TimeoutError):
        async with asyncio.timeout(RELEASE_TIMEOUT_S):
            await transfer.release_kv(handle)
