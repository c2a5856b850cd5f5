"""The engine pool: where the gateway's generations run, and how they survive engines.

Contract with the API (the only thing it uses):

    async for chunk in pool.generate(session_id, input_ids, sampling_params, rid): ...
    await pool.close_session(session_id)

- `generate` yields `GenerationChunk`s holding only the tokens that are NEW since
  the previous chunk, with one logprob and one weight version per token. The last
  chunk carries `finish_reason` in SGLang's form (`{"type": "stop"|"length"|"abort",
  ...}`) and may hold no tokens. Concatenating every chunk's `token_ids` gives
  exactly the sampled completion: no token is duplicated or lost.
- Before the first chunk it may raise `PoolBusy` (admission limit reached: answer
  429 with `Retry-After: exc.retry_after_s`) or `PoolUnavailable` (no healthy
  engine: 503); after tokens were delivered, `PoolUnavailable` only when no engine
  is healthy again within `resume_timeout_s`. `EngineRejected` from the engine
  driver (bad input, 400) passes through unchanged.
- `sampling_params` uses SGLang's names, the fields of `engines.protocol.SamplingParams`
  (another key is a `ValueError`); `max_new_tokens` defaults to 128 as in SGLang and
  bounds the whole generation, across resumes.
- It resumes transparently: when the engine dies mid-generation, when the
  operator pauses with abort-resume for a weight update, or when the engine is
  drained with migration, the generation is re-issued on a healthy engine from
  prompt + partial output, with `max_new_tokens` reduced by the tokens already
  produced. The consumer sees one uninterrupted stream; each
  token keeps the weight version that produced it. A resumed continuation is a
  fresh sample: SGLang 0.5.23 keys its sampling noise on (seed, absolute position)
  (`srt/layers/sampler.py`, `multinomial_with_seed`), so a resume with the call's
  `sampling_seed` would replay the tokens it had already drawn at those positions;
  each resume gets its own seed instead, derived from the call's seed and the
  resume's number (`resume_seed`), so that a run can still be replayed. A `stop`
  string that straddles the resume point is not matched (stop token IDs always are).
- Request IDs: the first attempt runs as `rid`, resume k as `resume_rid(rid, k)`, which
  does not start with `rid` nor with another resume's ID: SGLang 0.5.23 aborts every
  request whose rid starts with the one named (`srt/managers/scheduler.py`,
  `abort_request`), so a late abort of an interrupted attempt must not reach its resume.
  The caller's rids must be prefix-free among themselves and not begin with "resume"
  (the gateway's, `call-` and 16 hex digits, are).
- Weight versions: engines report `meta_info.weight_version` as a string (SGLang);
  the pool converts it with `int()`, and maps a string that is not an integer to
  -1 ("unknown", the same value the tree gives prompt tokens).

New generations wait (they are not refused) while the pool is paused.
Routing is decided by `router.Router`; the engine records, their health checks and
weights live in `fleet.Fleet`; engines are driven through the `Engine`
protocol of `engines/protocol.py` (`SGLangClient` by default; pass
`driver_factory` for another driver, e.g. vLLM's).

Exceptions: `PoolError` <- `PoolBusy`, `PoolUnavailable`, `UnknownEngine`, defined in
`errors.py` under the gateway's root (imported here, where they are raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.engines.client import SGLangClient
from undertow.gateway.engines.protocol import (
    SEED_BITS,
    EngineError,
    EngineUnavailable,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
    TokenIdsJson,
    WeightsNotUpdated,
)
from undertow.gateway.engines.protocol import Engine as EngineDriver
from undertow.gateway.errors import PoolBusy, PoolError, PoolUnavailable, UnknownEngine
from undertow.gateway.fleet import Attempt, Engine, Fleet
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.migration import (
    MigrationConfig,
    StagedResume,
    migrate_attempt,
    resume_stream,
)
from undertow.gateway.router import EngineLoad, EngineState, Router, RouterConfig

__all__ = ["PAUSE_MODES", "EnginePool", "GenerationChunk", "PoolBusy", "PoolConfig", "PoolError",
           "PoolUnavailable", "UnknownEngine", "parse_weight_version", "resume_rid",
           "resume_seed"]

UNKNOWN_WEIGHT_VERSION = -1
PAUSE_MODES = ("drain", "abort_resume")


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one generation since the previous chunk (see module doc)."""

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: dict | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class PoolConfig:
    """Routing and admission (`router`); how often dead engines are probed; how long
    a half-done generation waits for a healthy engine to resume on; how long a drain
    pause waits before aborting (and later resuming) what still runs (None: forever)."""

    router: RouterConfig = field(default_factory=RouterConfig)
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    resume_timeout_s: float = 120.0
    drain_timeout_s: float | None = None
    abort_retry_interval_s: float = 0.2
    migration: MigrationConfig = field(default_factory=MigrationConfig)


def parse_weight_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return UNKNOWN_WEIGHT_VERSION


class EnginePool:
    """Engines, their states and loads; generation with transparent resume; pause,
    weight updates, drain and removal. Create it, `await start()`, `await close()`."""

    def __init__(self, urls: Sequence[str] = (), config: PoolConfig | None = None,
                 metrics: GatewayMetrics | None = None,
                 driver_factory: Callable[[str], EngineDriver] = SGLangClient) -> None:
        self.config = config if config is not None else PoolConfig()
        self.metrics = metrics if metrics is not None else GatewayMetrics.create()
        self.router = Router(self.config.router)
        self.fleet = Fleet(driver_factory, self.metrics, self.config.health_timeout_s)
        self._initial_urls = list(urls)
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._health_task: asyncio.Task | None = None
        self._updating = asyncio.Lock()  # one weight update at a time
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        for url in self._initial_urls:
            await self.fleet.add(url, require_healthy=False)
        self._health_task = asyncio.create_task(
            self.fleet.run_health_checks(self.config.health_interval_s), name="engine-health")

    async def close(self) -> None:
        tasks = [*self._background, *([self._health_task] if self._health_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.fleet.close()

    @property
    def engines(self) -> list[Engine]:
        return self.fleet.engines

    def engine(self, engine_id: str) -> Engine:
        engine = self.fleet.get(engine_id)
        if engine is None:
            raise UnknownEngine(f"no engine {engine_id!r} in the pool (have "
                                f"{[e.engine_id for e in self.fleet.engines]})")
        return engine

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe(self.router.num_pinned(e.engine_id)) for e in self.fleet.engines]

    @property
    def paused(self) -> bool:
        return not self._admitting.is_set()

    async def close_session(self, session_id: str) -> None:
        self.router.unpin(session_id)

    # -- generation ---------------------------------------------------------------------

    async def generate(self, session_id: str, input_ids: list[int], sampling_params: dict,
                       rid: str, *, input_ids_json: TokenIdsJson | None = None
                       ) -> AsyncIterator[GenerationChunk]:
        """Streams the generation's new tokens; see the module doc for the contract.
        `input_ids_json`, the JSON array of `input_ids` where the caller has it, is sent
        as it is (a resume, whose input has grown, is serialised anew)."""
        produced: list[int] = []
        max_new = sampling_params.get("max_new_tokens", SamplingParams.max_new_tokens)
        cause: str | None = None
        cached_tokens = 0
        staged: StagedResume | None = None  # a KV migration's staging, for the next attempt
        for num_attempt in itertools.count():
            if cause is not None:
                self.metrics.resumes.inc(cause=cause)
            if len(produced) >= max_new:
                yield GenerationChunk([], [], [], {"type": "length", "length": max_new},
                                      cached_tokens)
                return
            attempt_rid = rid if num_attempt == 0 else resume_rid(rid, num_attempt)
            params = _remaining_params(sampling_params, len(produced), num_attempt)
            prompt_ids = input_ids + produced if produced else input_ids  # never mutated
            attempt = await self._admit(session_id, prompt_ids, attempt_rid,
                                        admitted=num_attempt > 0, waits=bool(produced))
            pieces = self._stream_attempt(attempt, prompt_ids, params, staged,
                                          None if produced else input_ids_json)
            try:
                async with contextlib.aclosing(pieces):
                    async for piece in pieces:
                        if num_attempt == 0:
                            cached_tokens = piece.cached_tokens or 0
                        final = _finish_dict(piece.finish_reason)
                        if attempt.interrupted_by and final and final["type"] == "abort":
                            final = None
                        token_ids = list(piece.output_ids)
                        produced.extend(token_ids)
                        if token_ids or final is not None:
                            version = parse_weight_version(piece.weight_version)
                            yield GenerationChunk(
                                token_ids, _logprobs(piece), [version] * len(token_ids),
                                final, cached_tokens)
                        if final is not None:
                            return
                cause = attempt.interrupted_by or "engine_died"
                if attempt.interrupted_by is None:
                    await self._mark_dead(attempt.engine, "stream ended without finish_reason")
            except EngineUnavailable as error:
                cause = attempt.interrupted_by or "engine_died"
                if attempt.interrupted_by is None:
                    await self._mark_dead(attempt.engine, str(error))
            if attempt.handover is not None:  # a KV migration finishes its copy first
                await attempt.handover.wait()
            staged = attempt.staged

    async def _stream_attempt(self, attempt: Attempt, input_ids: list[int],
                              params: SamplingParams, staged: StagedResume | None = None,
                              input_ids_json: TokenIdsJson | None = None
                              ) -> AsyncIterator[GenerateChunk]:
        """The engine's pieces for one attempt. A task reads the engine into a queue, so
        that the attempt ends (and stops counting as in flight) when the ENGINE is done,
        however slowly the consumer reads; the consumer leaving aborts the request.
        Once the engine has sent its finishing piece the attempt has ended; a consumer
        that leaves then leaves the pump to read the end of the stream (`[DONE]`) in
        the background instead: aborting a finished request would cost the engine a
        request and the gateway its keep-alive connection (a new TCP connection for the
        next generation), and waiting for it would delay the reply."""
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.create_task(self._pump(attempt, input_ids, params, queue, staged,
                                              input_ids_json),
                                   name=f"generate-{attempt.rid}")
        finished = False
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if finished and not pump.done():
                self._end_attempt(attempt)
                self._background.add(pump)
                pump.add_done_callback(self._background.discard)
            elif not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    async def _pump(self, attempt: Attempt, input_ids: list[int], params: SamplingParams,
                    queue: asyncio.Queue, staged: StagedResume | None = None,
                    input_ids_json: TokenIdsJson | None = None) -> None:
        engine = attempt.engine
        request = GenerateRequest(input_ids=input_ids, sampling_params=params,
                                  rid=attempt.rid, return_logprob=True,
                                  input_ids_json=input_ids_json)
        finished = False  # the engine sent its finishing piece: nothing is left to abort
        try:
            async for piece in resume_stream(engine, request, staged):
                attempt.output_ids.extend(piece.output_ids)
                finished = piece.finish_reason is not None
                queue.put_nowait(piece)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            if engine.state is not EngineState.DEAD and not finished:
                self._spawn(self._abort_quietly(engine, attempt.rid))
            raise
        except Exception as error:  # handed to the consumer, which decides
            queue.put_nowait(error)
        finally:
            self._end_attempt(attempt)

    def _end_attempt(self, attempt: Attempt) -> None:
        """The attempt no longer counts as in flight on its engine (idempotent)."""
        if attempt in attempt.engine.attempts:
            attempt.engine.attempts.discard(attempt)
            self.fleet.publish_load(attempt.engine)
            if self.fleet.has_waiters:  # a pause, drain or removal waits on the change
                self._spawn(self.fleet.notify())

    async def _admit(self, session_id: str, token_ids: list[int], rid: str, *,
                     admitted: bool, waits: bool) -> Attempt:
        """Waits while paused, then routes and registers the attempt (no await between
        the two, so that admission bounds hold). A generation `admitted` before (a
        resume) skips the admission bounds; one that `waits` (the consumer has seen
        tokens) waits up to `resume_timeout_s` for a healthy engine instead of
        failing at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.resume_timeout_s
        while True:
            await self._admitting.wait()
            loads = [EngineLoad(e.engine_id, e.state, len(e.attempts)) for e in self.engines]
            decision = self.router.route(session_id, token_ids, loads, bounded=not admitted)
            if decision.engine_id is not None and self._admitting.is_set():
                engine = self.engine(decision.engine_id)
                self.router.assign(session_id, engine.engine_id, token_ids)
                attempt = Attempt(rid, engine, session_id=session_id, token_ids=token_ids)
                engine.attempts.add(attempt)
                self.metrics.engine_generations.inc(engine=engine.engine_id)
                self.fleet.publish_load(engine)
                return attempt
            if decision.engine_id is not None:
                continue
            if not waits:
                if decision.reason == "busy":
                    self.metrics.admission_refusals.inc()
                    raise PoolBusy(decision.retry_after_s)
                raise PoolUnavailable("no healthy engine to generate on; add one with "
                                      "POST /admin/engines or wait for one to recover")
            if loop.time() >= deadline:
                raise PoolUnavailable(f"no healthy engine to resume generation {rid} on "
                                      f"within {self.config.resume_timeout_s} s")
            await self.fleet.wait_for_change(deadline - loop.time())

    # -- engine lifecycle ---------------------------------------------------------------

    async def add_engine(self, url: str, *, require_healthy: bool = True) -> Engine:
        """Adds an engine (or returns one with the same URL, back to service if it was
        draining). An engine that fails its health check is refused."""
        engine = self.fleet.by_url(url)
        if engine is not None:
            if engine.state is EngineState.DRAINING:
                await self.fleet.set_state(engine, EngineState.HEALTHY)
            return engine
        engine = await self.fleet.add(url, require_healthy=require_healthy)
        if engine is None:
            raise PoolUnavailable(f"engine at {url} does not answer /health or cannot load the "
                                  f"pool's weights {self.fleet.weights}; start it first")
        return engine

    async def drain_engine(self, engine_id: str, *, migrate: bool = False) -> Engine:
        """No new generations go to the engine and its sessions are re-pinned elsewhere
        on their next call; its in-flight generations finish there, or with `migrate`
        are aborted and resumed on other engines (with their KV copied there first when
        both engines can, see `migration.py`)."""
        engine = self.engine(engine_id)
        if engine.state is EngineState.HEALTHY:
            await self.fleet.set_state(engine, EngineState.DRAINING)
        self.router.unpin_engine(engine_id)
        if migrate:
            await asyncio.gather(*(
                migrate_attempt(attempt, self._migration_target(attempt), self.config.migration,
                                lambda attempts: self._interrupt(attempts, "migrate"))
                for attempt in list(engine.attempts)))
        return engine

    def _migration_target(self, attempt: Attempt) -> Engine | None:
        """Routes the attempt's session now (to the engine its resume will use) and pins it
        there; None when no healthy engine is left."""
        loads = [EngineLoad(e.engine_id, e.state, len(e.attempts)) for e in self.engines]
        decision = self.router.route(attempt.session_id, attempt.token_ids, loads,
                                     bounded=False)
        if decision.engine_id is None:
            return None
        self.router.assign(attempt.session_id, decision.engine_id, attempt.token_ids)
        return self.engine(decision.engine_id)

    async def remove_engine(self, engine_id: str, *, migrate: bool = True) -> None:
        """Drains the engine, waits until nothing of the pool runs on it, and drops it."""
        engine = await self.drain_engine(engine_id, migrate=migrate)
        await self.fleet.wait_until(lambda: not engine.attempts)
        self.router.forget_engine(engine_id)
        await self.fleet.drop(engine)

    async def _mark_dead(self, engine: Engine, why: str) -> None:
        if await self.fleet.mark_dead(engine, why):
            self.router.forget_engine(engine.engine_id)

    # -- pause, resume, weight updates --------------------------------------------------

    async def pause(self, mode: str) -> None:
        """Stops admitting generations (new ones wait). `drain`: waits until in-flight
        generations finish (past `drain_timeout_s`, the rest are aborted and resumed
        as in abort_resume). `abort_resume`: aborts them; each resumes from its
        partial output after `resume()`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._admitting.clear()

        def idle() -> bool:
            return not self.fleet.in_flight()

        if mode == "drain":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.drain_timeout_s):
                    await self.fleet.wait_until(idle)
        await self._interrupt(self.fleet.in_flight(), "pause")
        await self.fleet.wait_until(idle)

    async def resume(self) -> None:
        self._admitting.set()
        await self.fleet.notify()

    async def update_weights(self, model_path: str, weight_version: int | str,
                             mode: str = "drain") -> dict[str, Any]:
        """pause(mode) -> update_weights_from_disk on every live engine -> resume().
        An engine whose update fails is drained (it serves stale weights) and named
        in the result. `pool_weights` in the result are the weights an engine that
        joins or returns later is given: the pushed ones when at least one live engine
        loaded them, or when no engine was live (nothing could refuse them; an engine
        that cannot load them is then refused when it joins); otherwise the previous."""
        async with self._updating:
            await self.pause(mode)
            try:
                failed = await self._load_weights(str(model_path), str(weight_version))
            finally:
                await self.resume()
        weights = self.fleet.weights
        return {"weight_version": str(weight_version), "failed": failed,
                "updated": [e.engine_id for e in self.engines
                            if e.weight_version == str(weight_version)],
                "pool_weights": None if weights is None else
                {"model_path": weights[0], "weight_version": weights[1]}}

    async def _load_weights(self, model_path: str, weight_version: str) -> dict[str, str]:
        """update_weights_from_disk on every live engine; drains those that fail.
        Records the weights as the pool's unless every live engine failed them."""
        live = [e for e in self.engines if e.state is not EngineState.DEAD]
        results = await asyncio.gather(
            *(e.client.update_weights_from_disk(model_path, weight_version) for e in live),
            return_exceptions=True)
        failed: dict[str, str] = {}
        for engine, result in zip(live, results, strict=True):
            if isinstance(result, Exception):
                failed[engine.engine_id] = str(result)
                if isinstance(result, WeightsNotUpdated):  # what the engine really serves
                    engine.weight_version = result.weight_version
                await self.drain_engine(engine.engine_id)
            else:
                engine.weight_version = weight_version
        if not live or len(failed) < len(live):  # weights every engine refused are not
            self.fleet.weights = (model_path, weight_version)
        return failed

    async def _interrupt(self, attempts: list[Attempt], cause: str) -> None:
        """Marks the attempts for resumption and aborts them on their engines, repeating
        the abort until each has ended (a request still in transit when the first
        abort arrives is not yet known to the engine)."""
        for attempt in attempts:
            attempt.interrupted_by = cause
        pending = [a for a in attempts if a in a.engine.attempts]
        while pending:
            await asyncio.gather(*(self._abort_quietly(a.engine, a.rid) for a in pending))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.abort_retry_interval_s):
                    await self.fleet.wait_until(lambda left=pending: all(
                        a not in a.engine.attempts for a in left))
            pending = [a for a in pending if a in a.engine.attempts
                       and a.engine.state is not EngineState.DEAD]

    async def _abort_quietly(self, engine: Engine, rid: str) -> None:
        with contextlib.suppress(EngineError, TimeoutError):
            async with asyncio.timeout(self.config.health_timeout_s):
                await engine.client.abort(rid)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def resume_rid(rid: str, num_attempt: int) -> str:
    """The request ID of resume `num_attempt` (>= 1) of generation `rid`: it starts with
    neither `rid` nor another resume's ID (see the module doc), and still names `rid`."""
    return f"resume{num_attempt}~{rid}"


def resume_seed(seed: int, num_attempt: int) -> int:
    """The `sampling_seed` of resume `num_attempt` of a generation seeded `seed`: another
    seed, the same on every replay of the run."""
    digest = hashlib.blake2b(f"{seed}/{num_attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def _remaining_params(sampling_params: dict, num_produced: int,
                      num_attempt: int = 0) -> SamplingParams:
    """The sampling parameters (SGLang names) for attempt `num_attempt` after `num_produced`
    tokens: `max_new_tokens` is reduced by what was produced, and a resume's seed is its
    own (`resume_seed`; without a seed the driver draws a fresh one)."""
    unknown = set(sampling_params) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"sampling parameters {sorted(unknown)} are not part of the engine "
                         f"protocol; use {sorted(_SAMPLING_FIELDS)}")
    params = {name: tuple(value) if isinstance(value, list) else value
              for name, value in sampling_params.items()}
    if "max_new_tokens" in params:
        params["max_new_tokens"] = max(params["max_new_tokens"] - num_produced, 0)
    if num_attempt and params.get("sampling_seed") is not None:
        params["sampling_seed"] = resume_seed(params["sampling_seed"], num_attempt)
    return SamplingParams(**params)


def _logprobs(piece: GenerateChunk) -> list[float]:
    """One logprob per output token (NaN where the engine reported none)."""
    pairs = piece.output_token_logprobs
    if len(pairs) == len(piece.output_ids):
        return [logprob for logprob, _ in pairs]
    return [math.nan] * len(piece.output_ids)


def _finish_dict(reason: FinishReason | None) -> dict | None:
    """SGLang's `finish_reason` object, as the API consumes it."""
    if reason is None:
        return None
    data: dict[str, Any] = {"type": reason.type, "matched": reason.matched}
    if reason.message is not None:
        data["message"] = reason.message
    return data
