"""The engine pool: where the gateway's generations run, and how they survive engines.

Contract with the API (the only thing it uses):

    async for chunk in pool.generate(session_id, input_ids, params, rid): ...
    await pool.close_session(session_id)

- `generate` yields `GenerationChunk`s holding only the tokens that are NEW since
  the previous chunk, with one logprob and one weight version per token. The last
  chunk carries `finish_reason` in SGLang's form (`{"type": "stop"|"length"|"abort",
  ...}`) and may hold no tokens. Concatenating every chunk's `token_ids` gives
  exactly the sampled completion: no token is duplicated or lost. A chunk holds every
  token that came since the consumer took the previous one (one engine event or many);
  with `live=False`, all that an attempt brought, once it is over.
- Before the first chunk it may wait for admission (every engine at its bound: the call
  queues, fairly across groups and sessions, `admission.py`), then raise `PoolBusy` (still
  no room after `RouterConfig.admission_wait_s`: answer 429 with `Retry-After:
  exc.retry_after_s`), `CallerLeft` (its client left while it waited) or
  `PoolUnavailable` (no healthy engine, or the pool closes: 503); after tokens were
  delivered, `PoolUnavailable` only when no engine is healthy again within
  `resume_timeout_s`. `EngineRejected` from the engine driver (bad input, 400) passes
  through unchanged.
- `params` are the call's `engines.protocol.SamplingParams`, handed to the engine driver
  as they are (a resume's with its own seed and bound); `max_new_tokens` (128 by default,
  as in SGLang; None: the context's room) bounds the whole generation, across resumes.
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

New generations wait (they are not refused) while the pool is paused. Who a generation
is for (its group, whether its client is still there) is `admission.CALLER`, which the API
sets for the call's task.

How it is built: `EnginePool` is the facade the API and the learner's link use; it owns
the engines' lifecycle (add, drain, remove) and composes one collaborator per concern:
- `admission.Admission`: the pause gate, routing (decided by `router.Router`) and each
  engine's attempts in flight;
- `inflight.InFlight`: `generate` itself, attempt by attempt, with resume after an
  engine's death, an abort-resume pause or a migration (`migration.py` moves the KV);
- `weight_updates.WeightUpdates`: pause, resume and weight updates;
- `fleet.Fleet`: the engine records, their health checks and the pool's weights;
- `background.BackgroundTasks`: the tasks the pool does not await, cancelled on close.
Engines are driven through the `EngineDriver` protocol of `engines/protocol.py`
(`SGLangClient` by default; pass `driver_factory` for another driver, e.g. vLLM's), and
migration moves KV through its `KVTransfer` protocol where both engines have it.

Exceptions: `PoolError` <- `PoolBusy`, `PoolUnavailable`, `CallerLeft`, `UnknownEngine`,
defined in `errors.py` under the gateway's root (raised here and in `admission.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.engines.admission import Admission
from undertow.gateway.engines.background import BackgroundTasks
from undertow.gateway.engines.client import SGLangClient
from undertow.gateway.engines.fleet import EngineRecord, Fleet
from undertow.gateway.engines.inflight import (
    GenerationChunk,
    InFlight,
    InFlightConfig,
    parse_weight_version,
    resume_rid,
    resume_seed,
)
from undertow.gateway.engines.migration import MigrationConfig
from undertow.gateway.engines.protocol import EngineDriver, SamplingParams, TokenIdsJson
from undertow.gateway.engines.router import EngineState, Router, RouterConfig
from undertow.gateway.engines.weight_updates import PAUSE_MODES, WeightUpdates
from undertow.gateway.errors import PoolBusy, PoolError, PoolUnavailable, UnknownEngine
from undertow.gateway.metrics import GatewayMetrics

__all__ = ["PAUSE_MODES", "EnginePool", "GenerationChunk", "PoolBusy", "PoolConfig", "PoolError",
           "PoolUnavailable", "UnknownEngine", "parse_weight_version", "resume_rid",
           "resume_seed"]


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


class EnginePool:
    """Engines, their states and loads; generation with transparent resume; pause,
    weight updates, drain and removal. Create it, `await start()`, `await close()`."""

    def __init__(self, urls: Sequence[str] = (), config: PoolConfig | None = None,
                 metrics: GatewayMetrics | None = None,
                 driver_factory: Callable[[str], EngineDriver] = SGLangClient) -> None:
        config = config if config is not None else PoolConfig()
        self.metrics = metrics if metrics is not None else GatewayMetrics.create()
        self.router = Router(config.router)
        self.fleet = Fleet(driver_factory, self.metrics, config.health_timeout_s)
        self._initial_urls = list(urls)
        self._health_task: asyncio.Task | None = None
        self._background = BackgroundTasks()
        self.admission = Admission(self.router, self.fleet, self.metrics,
                                   config.resume_timeout_s, self._background.spawn)
        self.inflight = InFlight(self.admission, self.fleet, self.metrics, self._background,
                                 InFlightConfig())
        self.weight_updates = WeightUpdates(self.admission, self.inflight, self.fleet,
                                            self.drain_engine)
        self.config = config

    @property
    def config(self) -> PoolConfig:
        return self._config

    @config.setter
    def config(self, config: PoolConfig) -> None:
        """Hands the timeouts and the migration settings to the collaborators; a running
        pool may be given another config (its router and health timeout stay as built)."""
        self._config = config
        self.admission.resume_timeout_s = config.resume_timeout_s
        self.inflight.config = InFlightConfig(config.health_timeout_s,
                                              config.abort_retry_interval_s, config.migration)
        self.weight_updates.drain_timeout_s = config.drain_timeout_s

    async def start(self) -> None:
        for url in self._initial_urls:
            await self.fleet.add(url, require_healthy=False)
        self._health_task = asyncio.create_task(
            self.fleet.run_health_checks(self.config.health_interval_s), name="engine-health")

    async def close(self) -> None:
        self.admission.close()
        await self._background.cancel_all(*([self._health_task] if self._health_task else []))
        await self.fleet.close()

    @property
    def engines(self) -> list[EngineRecord]:
        return self.fleet.engines

    def engine(self, engine_id: str) -> EngineRecord:
        engine = self.fleet.get(engine_id)
        if engine is None:
            raise UnknownEngine(f"no engine {engine_id!r} in the pool (have "
                                f"{[e.engine_id for e in self.fleet.engines]})")
        return engine

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe(self.router.num_pinned(e.engine_id)) for e in self.fleet.engines]

    @property
    def paused(self) -> bool:
        return self.admission.paused

    async def close_session(self, session_id: str) -> None:
        self.router.unpin(session_id)
        self.admission.forget_session(session_id)

    def generate(self, session_id: str, input_ids: Sequence[int], params: SamplingParams,
                 rid: str, *, input_ids_json: TokenIdsJson | None = None, live: bool = True
                 ) -> AsyncGenerator[GenerationChunk, None]:
        """Streams the generation's new tokens; see the module doc for the contract
        (`InFlight.generate` runs it). `live=False`: chunks only as attempts end, for a
        consumer that needs the whole reply before it answers."""
        return self.inflight.generate(session_id, input_ids, params, rid,
                                      input_ids_json=input_ids_json, live=live)

    # -- engine lifecycle ---------------------------------------------------------------

    async def add_engine(self, url: str, *, require_healthy: bool = True) -> EngineRecord:
        """Adds an engine (or returns one with the same URL, back to service if it was
        draining). An engine that fails its health check is refused."""
        engine = self.fleet.by_url(url)
        if engine is not None:
            if engine.state is EngineState.DRAINING:
                await self.fleet.set_state(engine, EngineState.HEALTHY)
                self.admission.admit_waiting()
            return engine
        engine = await self.fleet.add(url, require_healthy=require_healthy)
        if engine is None:
            raise PoolUnavailable(f"engine at {url} does not answer /health or cannot load the "
                                  f"pool's weights {self.fleet.weights}; start it first")
        self.admission.admit_waiting()  # waiting calls get its slots
        return engine

    async def drain_engine(self, engine_id: str, *, migrate: bool = False) -> EngineRecord:
        """No new generations go to the engine and its sessions are re-pinned elsewhere
        on their next call; its in-flight generations finish there, or with `migrate`
        are aborted and resumed on other engines (with their KV copied there first when
        both engines can, see `migration.py`)."""
        engine = self.engine(engine_id)
        if engine.state is EngineState.HEALTHY:
            await self.fleet.set_state(engine, EngineState.DRAINING)
        self.router.unpin_engine(engine_id)
        self.admission.admit_waiting()  # fails the waiting calls if no healthy engine is left
        if migrate:
            await self.inflight.migrate(engine)
        return engine

    async def remove_engine(self, engine_id: str, *, migrate: bool = True) -> None:
        """Drains the engine, waits until nothing of the pool runs on it, and drops it."""
        engine = await self.drain_engine(engine_id, migrate=migrate)
        await self.fleet.wait_until(lambda: not engine.attempts)
        self.router.forget_engine(engine_id)
        await self.fleet.drop(engine)

    # -- pause, resume, weight updates (`weight_updates.py`) ----------------------------

    async def pause(self, mode: str) -> None:
        """See `WeightUpdates.pause`: new generations wait, running ones drain or are
        interrupted to resume after `resume()`."""
        await self.weight_updates.pause(mode)

    async def resume(self) -> None:
        await self.weight_updates.resume()

    async def update_weights(self, model_path: str, weight_version: int | str,
                             mode: str = "drain") -> dict[str, Any]:
        """pause(mode) -> update_weights_from_disk on every live engine -> resume();
        see `WeightUpdates.update` for the result."""
        return await self.weight_updates.update(model_path, weight_version, mode)
