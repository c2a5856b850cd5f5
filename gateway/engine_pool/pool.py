"""`EnginePool`: the facade of the engine pool, what the front and the learner's link use. Its
contract (chunks, waits and errors, resumes, request IDs, weight versions) and the
collaborators it is built from are in docs/engines.md, "The engine pool's contract".
Engines are driven through `engines/protocol.py`'s `EngineDriver` (`SGLangDriver` by
default; `driver_factory` for another). Its errors (`PoolError` and below) are drawn in the
gateway's `errors.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.engine_pool.admission import Admission
from undertow.gateway.engine_pool.background import BackgroundTasks
from undertow.gateway.engine_pool.fleet import EngineRecord, Fleet
from undertow.gateway.engine_pool.inflight import (
    GenerationChunk,
    InFlight,
    InFlightConfig,
    parse_weight_version,
    resume_rid,
    resume_seed,
)
from undertow.gateway.engine_pool.migration import MigrationConfig
from undertow.gateway.engine_pool.router import EngineState, Router, RouterConfig
from undertow.gateway.engine_pool.weight_updates import PAUSE_MODES, WeightUpdates
from undertow.gateway.engines.protocol import EngineDriver, GenerateRequest
from undertow.gateway.engines.sglang import SGLangDriver
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
                 driver_factory: Callable[[str], EngineDriver] = SGLangDriver) -> None:
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

    def generate(self, session_id: str, request: GenerateRequest, *, live: bool = True
                 ) -> AsyncGenerator[GenerationChunk, None]:
        """Streams the new tokens of `request`'s generation (built whole by the caller, with
        `input_ids`, and sent as it is; a resume derives its own); see docs/engines.md for
        the contract (`InFlight.generate` runs it). `live=False`: chunks only as attempts
        end, for a consumer that needs the whole reply before it answers."""
        return self.inflight.generate(session_id, request, live=live)

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
