"""KV migration: move an in-flight generation to another engine with its KV, not re-prefilled.

When the pool drains an engine with `migrate` (a cell moving to training), each in-flight
generation is aborted and resumed elsewhere from prompt + partial output (`pool.py`). Resumed
plainly, the target re-prefills the whole history: a pause that grows with the context. When
both engines have Undertow's `kv_transfer` extension (the built-in engine), `migrate_attempt`
does what Llumnix does instead, so that the pause does not grow with the context:

1. Pick the target and pin the session to it (the resume goes there).
2. Stages, while the source keeps decoding: copy the request's KV so far (by rid) to the
   target's prefix cache, then the positions produced during that copy, and so on, until a
   stage has at most `max_delta_tokens` new positions (or `max_stages` were run).
3. Cut-over: abort on the source, copy the last delta (from the source's prefix cache, where
   the aborted request's KV went), then let the generation resume: the target finds all but
   the last token cached and prefills one token.

The generation waits for step 3 through `Attempt.handover`, which is set however the copy
ends; any engine error during the copy just leaves less cached, and the resume re-prefills
the rest. The pause is the abort, one small delta and a one-token prefill.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from undertow.gateway.engines.protocol import EngineError
from undertow.gateway.fleet import Attempt, Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationConfig:
    """`kv_transfer` off makes every migration a plain re-prefill."""

    kv_transfer: bool = True
    max_delta_tokens: int = 32
    max_stages: int = 4


async def supports_kv_transfer(engine: Engine) -> bool:
    probe = getattr(engine.client, "supports_kv_transfer", None)
    return probe is not None and await probe()


async def migrate_attempt(attempt: Attempt, target: Engine | None, config: MigrationConfig,
                          interrupt: Callable[[list[Attempt]], Awaitable[None]]) -> int:
    """Move `attempt` to `target` as in the module doc; `interrupt` aborts it on its engine
    and returns once it has ended. Returns the number of tokens whose KV the target caches
    for the resume (0 when it was not copied)."""
    source = attempt.engine
    if (not config.kv_transfer or target is None
            or not await supports_kv_transfer(source) or not await supports_kv_transfer(target)):
        await interrupt([attempt])
        return 0
    attempt.handover = asyncio.Event()
    try:
        try:
            num_sent = await _copy_while_running(attempt, source, target, config)
        except EngineError as error:
            log.warning("KV copy of %s to %s failed (%s); it resumes by re-prefill",
                        attempt.rid, target.engine_id, error)
            await interrupt([attempt])
            return 0
        await interrupt([attempt])
        token_ids = attempt.token_ids + attempt.output_ids
        payload = await source.client.export_kv(input_ids=token_ids, start=num_sent)
        num_cached = await target.client.import_kv(payload)
        log.info("moved %s from %s to %s with %d tokens of KV (last delta: %d)", attempt.rid,
                 source.engine_id, target.engine_id, num_cached, payload.end - payload.start)
        return num_cached
    except EngineError as error:
        log.warning("the last KV delta of %s to %s failed (%s); the resume re-prefills it",
                    attempt.rid, target.engine_id, error)
        return 0
    finally:
        attempt.handover.set()


async def _copy_while_running(attempt: Attempt, source: Engine, target: Engine,
                              config: MigrationConfig) -> int:
    """Stages of the copy while the source decodes; returns the positions sent so far."""
    num_sent = 0
    for _ in range(config.max_stages):
        payload = await source.client.export_kv(rid=attempt.rid, start=num_sent)
        await target.client.import_kv(payload)
        num_new, num_sent = payload.end - num_sent, payload.end
        if num_new <= config.max_delta_tokens:
            break
    return num_sent
