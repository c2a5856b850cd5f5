"""Admission and routing: when a generation's attempt may start, and on which engine.

Flow: `Admission.admit` waits while the gate is closed (the pool is paused), asks
`router.Router` for an engine given every engine's state and load, pins the session there
and registers the attempt in that engine's `attempts`; `Admission.end` takes it out again
when the attempt is over, and wakes whoever waits on the fleet (a pause, a drain, a
removal). `route_now` routes and pins a session without admitting anything (where a
migration will resume it); `mark_dead` is the other way an engine leaves routing.

Invariants:
- An attempt counts on its engine (`EngineRecord.attempts`, the load the router sees and the
  in-flight gauge) from `admit` until `end`, and `end` is idempotent.
- Routing and registering happen with no await between them, so the router's admission
  bounds (`RouterConfig`) hold however many generations arrive together.
- New generations wait while the gate is closed; they are never refused for a pause.
  A first attempt is refused at once when every engine is busy (`PoolBusy`) or none is
  healthy (`PoolUnavailable`); a resume (`waits`) waits up to `resume_timeout_s` for a
  healthy engine instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from undertow.gateway.engines.fleet import Attempt, EngineRecord, Fleet
from undertow.gateway.engines.router import EngineLoad, Router
from undertow.gateway.errors import PoolBusy, PoolUnavailable
from undertow.gateway.metrics import GatewayMetrics

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


class Admission:
    """The pause gate, the router's decisions, and each engine's attempts in flight."""

    def __init__(self, router: Router, fleet: Fleet, metrics: GatewayMetrics,
                 resume_timeout_s: float, spawn: Spawn) -> None:
        self.router = router
        self.fleet = fleet
        self.metrics = metrics
        self.resume_timeout_s = resume_timeout_s
        self._spawn = spawn
        self._gate = asyncio.Event()
        self._gate.set()

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    def close_gate(self) -> None:
        """New attempts wait from now on (those already admitted run on)."""
        self._gate.clear()

    async def open_gate(self) -> None:
        self._gate.set()
        await self.fleet.notify()

    async def admit(self, session_id: str, token_ids: Sequence[int], rid: str, *,
                    admitted: bool, waits: bool) -> Attempt:
        """Waits while paused, then routes and registers the attempt (no await between
        the two, so that admission bounds hold). A generation `admitted` before (a
        resume) skips the admission bounds; one that `waits` (the consumer has seen
        tokens) waits up to `resume_timeout_s` for a healthy engine instead of
        failing at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.resume_timeout_s
        while True:
            await self._gate.wait()
            decision = self.router.route(session_id, token_ids, self._loads(),
                                         bounded=not admitted)
            if decision.engine_id is not None and self._gate.is_set():
                engine = self.fleet.get(decision.engine_id)
                assert engine is not None  # the router routes to the fleet's engines only
                return self._register(engine, session_id, token_ids, rid)
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
                                      f"within {self.resume_timeout_s} s")
            await self.fleet.wait_for_change(deadline - loop.time())

    def _register(self, engine: EngineRecord, session_id: str, token_ids: Sequence[int],
                  rid: str) -> Attempt:
        self.router.assign(session_id, engine.engine_id, token_ids)
        attempt = Attempt(rid, engine, session_id=session_id, token_ids=token_ids)
        engine.attempts.add(attempt)
        self.metrics.engine_generations.inc(engine=engine.engine_id)
        self.fleet.publish_load(engine)
        return attempt

    def end(self, attempt: Attempt) -> None:
        """The attempt no longer counts as in flight on its engine (idempotent)."""
        if attempt in attempt.engine.attempts:
            attempt.engine.attempts.discard(attempt)
            self.fleet.publish_load(attempt.engine)
            if self.fleet.has_waiters:  # a pause, drain or removal waits on the change
                self._spawn(self.fleet.notify())

    def route_now(self, session_id: str, token_ids: Sequence[int]) -> EngineRecord | None:
        """Routes the session now, past the admission bounds, and pins it there (the engine
        its next attempt will use); None when no healthy engine is left."""
        decision = self.router.route(session_id, token_ids, self._loads(), bounded=False)
        if decision.engine_id is None:
            return None
        self.router.assign(session_id, decision.engine_id, token_ids)
        return self.fleet.get(decision.engine_id)

    async def mark_dead(self, engine: EngineRecord, why: str) -> None:
        """The fleet marks the engine dead (it probes it until it answers again) and the
        router forgets the sessions pinned to it."""
        if await self.fleet.mark_dead(engine, why):
            self.router.forget_engine(engine.engine_id)

    def _loads(self) -> list[EngineLoad]:
        return [EngineLoad(e.engine_id, e.state, len(e.attempts)) for e in self.fleet.engines]
