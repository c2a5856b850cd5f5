"""The engines behind the pool: their states, loads, health checks and weights.

`EnginePool` (`pool.py`) owns one `Fleet` and decides what runs where; the fleet
keeps the engine records and their metrics true, probes dead engines until they
answer again, and makes sure that an engine which joins or returns serves the
weights last pushed to the pool. Waiting for a change (an engine's state or load)
goes through the fleet's condition.

Invariants:
- `EngineRecord.attempts` are exactly the requests the pool has in flight on that engine,
  so `len(attempts)` is its load, and `undertow_engine_in_flight` shows it.
- `undertow_engine_state{engine, state}` is 1 for the engine's current state and 0
  for the others; an engine that left the pool has no samples.
- A healthy engine serves `Fleet.weights` when that is set (the last update); until then
  (no update yet) the live engines that report a weight version report the same one: an
  engine on another is refused when it joins (`WeightVersionConflict`) and stays dead
  when it returns, so that a session never mixes weights by changing engines.
- `EngineRecord.honours_seeds` is what the engine said when it last joined or returned
  (`EngineDriver.honours_seeds`); `Fleet.honours_seeds` is what a call can rely on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from undertow.gateway.engine_pool.router import EngineState
from undertow.gateway.engines.protocol import EngineDriver, EngineError
from undertow.gateway.errors import PoolError
from undertow.gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from undertow.gateway.engine_pool.migration import StagedResume

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Attempt:
    """One request of a generation to one engine. `interrupted_by` is set when the
    pool itself aborts it ("pause" or "migrate"), so that its abort is resumed.
    `token_ids` are its input, `output_ids` what the engine returned so far; a KV
    migration (`migration.py`) sets `handover`, and the resume waits for it, then
    continues from `staged` (where the migration staged the history's KV) if set."""

    rid: str
    engine: EngineRecord
    interrupted_by: str | None = None
    session_id: str = ""
    token_ids: Sequence[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    handover: asyncio.Event | None = None
    staged: StagedResume | None = None


class WeightVersionConflict(PoolError, ValueError):
    """An engine joins a pool whose other engines serve another weight version, before any
    weights were pushed to it (so the pool cannot align it). A `ValueError` too: the
    operator's request to add it is refused (400)."""

    status = 400


@dataclass(eq=False)
class EngineRecord:
    """An engine in the pool (see the module's invariants). `model_path` is the model
    directory it reported loading last (its `ModelInfo`)."""

    engine_id: str
    url: str
    driver: EngineDriver
    state: EngineState = EngineState.HEALTHY
    attempts: set[Attempt] = field(default_factory=set)
    weight_version: str | None = None
    model_path: str | None = None
    honours_seeds: bool | None = None

    def describe(self, num_pinned: int) -> dict[str, Any]:
        return {"id": self.engine_id, "url": self.url, "state": str(self.state),
                "num_in_flight": len(self.attempts), "num_pinned_sessions": num_pinned,
                "weight_version": self.weight_version, "honours_seeds": self.honours_seeds}


class Fleet:
    """The engine records of one pool, keyed by ID ("e0", "e1", ... in order added)."""

    def __init__(self, driver_factory: Callable[[str], EngineDriver], metrics: GatewayMetrics,
                 health_timeout_s: float) -> None:
        self.metrics = metrics
        self.health_timeout_s = health_timeout_s
        self.weights: tuple[str, str] | None = None  # (model_path, weight_version)
        self._driver_factory = driver_factory
        self._engines: dict[str, EngineRecord] = {}
        self._engine_ids = (f"e{n}" for n in itertools.count())
        self._changed = asyncio.Condition()
        self._num_waiters = 0

    @property
    def engines(self) -> list[EngineRecord]:
        return list(self._engines.values())

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def by_url(self, url: str) -> EngineRecord | None:
        return next((e for e in self._engines.values() if e.url == url.rstrip("/")), None)

    def in_flight(self) -> list[Attempt]:
        return [attempt for engine in self._engines.values() for attempt in engine.attempts]

    @property
    def honours_seeds(self) -> bool | None:
        """Whether a call's recorded seed replays it on whichever live engine serves it:
        False when one of them ignores seeds, None when one does not say (or none is live)."""
        answers = [e.honours_seeds for e in self._engines.values()
                   if e.state is not EngineState.DEAD]
        if False in answers:
            return False
        return None if not answers or None in answers else True

    async def add(self, url: str, *, require_healthy: bool) -> EngineRecord | None:
        """A new engine record, healthy or (without `require_healthy`) dead until its
        health check passes; None when it is required healthy and is not. Raises
        `WeightVersionConflict` for an engine on other weights than the pool's live engines
        before any update (see the module's invariants)."""
        url = url.rstrip("/")
        engine = EngineRecord(next(self._engine_ids), url, self._driver_factory(url))
        healthy = await self.check(engine)
        other = self._version_conflict(engine)
        if other is not None:
            await engine.driver.close()
            raise WeightVersionConflict(self._conflict_message(engine, other))
        if require_healthy and not healthy:
            await engine.driver.close()
            return None
        self._engines[engine.engine_id] = engine
        await self.set_state(engine, EngineState.HEALTHY if healthy else EngineState.DEAD)
        return engine

    async def drop(self, engine: EngineRecord) -> None:
        self._engines.pop(engine.engine_id, None)
        self.metrics.engine_state.remove(engine=engine.engine_id)
        self.metrics.engine_in_flight.remove(engine=engine.engine_id)
        await engine.driver.close()
        await self.notify()

    async def close(self) -> None:
        for engine in list(self._engines.values()):
            await engine.driver.close()
        self._engines.clear()

    async def set_state(self, engine: EngineRecord, state: EngineState) -> None:
        engine.state = state
        for each in EngineState:
            self.metrics.engine_state.set(1 if each is state else 0,
                                          engine=engine.engine_id, state=str(each))
        self.publish_load(engine)
        await self.notify()

    async def mark_dead(self, engine: EngineRecord, why: str) -> bool:
        """True when this call found the engine alive and marked it dead."""
        if engine.state is EngineState.DEAD or engine.engine_id not in self._engines:
            return False
        log.warning("engine %s at %s is dead (%s); resuming its generations elsewhere",
                    engine.engine_id, engine.url, why)
        await self.set_state(engine, EngineState.DEAD)
        return True

    def publish_load(self, engine: EngineRecord) -> None:
        if engine.engine_id in self._engines:
            self.metrics.engine_in_flight.set(len(engine.attempts), engine=engine.engine_id)

    async def check(self, engine: EngineRecord) -> bool:
        """True when the engine passes its driver's cheap health probe (SGLang: `/ready`,
        never the probe that generates, which blocks while the engine is paused or loads
        weights) and serves the fleet's weights; one
        that joins or comes back with other weights is first updated to them, so that
        a session never mixes weights of different versions by changing engines."""
        try:
            async with asyncio.timeout(self.health_timeout_s):
                if not await engine.driver.health():
                    return False
        except TimeoutError:
            return False
        try:
            async with asyncio.timeout(self.health_timeout_s):
                info = await engine.driver.model_info()
                engine.weight_version, engine.model_path = info.weight_version, info.model_path
                engine.honours_seeds = await engine.driver.honours_seeds()
        except (TimeoutError, EngineError):
            engine.weight_version = None  # unknown: updated below when weights were pushed
        if self.weights is None:
            other = self._version_conflict(engine)
            if other is not None:
                log.warning("%s", self._conflict_message(engine, other))
            return other is None
        if engine.weight_version == self.weights[1]:
            return True
        try:
            await engine.driver.update_weights_from_disk(*self.weights)
        except EngineError as error:
            log.warning("engine %s at %s cannot load weights %s: %s", engine.engine_id,
                        engine.url, self.weights, error)
            return False
        engine.weight_version = self.weights[1]
        return True

    def _version_conflict(self, engine: EngineRecord) -> EngineRecord | None:
        """Before any update: a live engine other than `engine` that reports another weight
        version than it does."""
        if self.weights is not None or engine.weight_version is None:
            return None
        return next((other for other in self._engines.values()
                     if other is not engine and other.state is not EngineState.DEAD
                     and other.weight_version not in (None, engine.weight_version)), None)

    @staticmethod
    def _conflict_message(engine: EngineRecord, other: EngineRecord) -> str:
        return (f"engine at {engine.url} serves weight version {engine.weight_version!r}, but "
                f"engine {other.engine_id} at {other.url} serves {other.weight_version!r}, and "
                "no weights were pushed to the pool yet: a session moved between them would "
                "mix weights. Start every engine on the same weights (and --weight-version), "
                "or push weights first (POST /admin/update_weights), which engines that join "
                "later are given")

    async def run_health_checks(self, interval_s: float) -> None:
        """Forever (until cancelled): probes dead engines; one that passes `check` is
        healthy again, with an empty prefix record (its cache did not survive)."""
        while True:
            await asyncio.sleep(interval_s)
            for engine in list(self._engines.values()):
                if engine.state is EngineState.DEAD and await self.check(engine):
                    log.info("engine %s at %s is back", engine.engine_id, engine.url)
                    await self.set_state(engine, EngineState.HEALTHY)

    @property
    def has_waiters(self) -> bool:
        """True while a `wait_until` or `wait_for_change` runs: a change needs `notify`
        only then (a later waiter checks its predicate first, or waits for a later change)."""
        return self._num_waiters > 0

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        self._num_waiters += 1
        try:
            async with self._changed:
                await self._changed.wait_for(predicate)
        finally:
            self._num_waiters -= 1

    async def wait_for_change(self, timeout_s: float) -> None:
        self._num_waiters += 1
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout_s, 0.0)), self._changed:
                    await self._changed.wait()
        finally:
            self._num_waiters -= 1
