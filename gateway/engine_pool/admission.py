"""Admission and routing: when a generation's attempt may start, and on which engine.

Flow: `Admission.admit` asks `router.Router` for an engine given every engine's state and
load, pins the session there and registers the attempt in that engine's `attempts`;
`Admission.end` takes it out again when the attempt is over, admits the next waiting call
into the slot, and wakes whoever waits on the fleet (a pause, a drain, a removal).
A first attempt that finds every engine at its bound (or the pool paused) waits in the
`AdmissionQueue` (`admission_queue.py`: fair across groups and sessions) for up to
`RouterConfig.admission_wait_s`, and only then is refused (`PoolBusy`, the API's 429 with
`Retry-After`). `route_now` routes and pins a session without admitting anything (where a
migration will resume it); `mark_dead` is the other way an engine leaves routing.

Who a call is for (`Caller`: its group, and whether its client is still connected) is set
by the API for the call's task in `CALLER`, a context variable: the four layers between
the HTTP handler and this queue (call runner, sampler, pool, in-flight) carry no request
objects, and none of them needs to know.

Invariants:
- An attempt counts on its engine (`EngineRecord.attempts`, the load the router sees and the
  in-flight gauge) from `admit` until `end`, and `end` is idempotent.
- Routing and registering happen with no await between them, so the router's admission
  bounds (`RouterConfig`) hold however many generations arrive together; a waiter is
  routed and registered by whoever frees the slot, and handed its attempt.
- A new call goes straight to an engine only when nobody waits: it never passes a waiter.
- Every waiter leaves the queue exactly once: admitted, refused past its wait, gone with
  its client (`CallerLeft`, checked every `CLIENT_CHECK_INTERVAL_S`), or failed with
  `PoolUnavailable` when no healthy engine is left or the pool closes.
- New generations are never refused for a pause: while the gate is closed they wait
  (queued, their wait bound restarting), and those admitted run on. A resume is never
  queued: `waits` has it wait up to `resume_timeout_s` for a healthy engine instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from contextvars import ContextVar
from typing import Any

from undertow.gateway.engine_pool.admission_queue import AdmissionQueue, Caller, Waiter
from undertow.gateway.engine_pool.fleet import Attempt, EngineRecord, Fleet
from undertow.gateway.engine_pool.router import EngineLoad, Router
from undertow.gateway.errors import CallerLeft, PoolBusy, PoolUnavailable
from undertow.gateway.metrics import GatewayMetrics

__all__ = ["CALLER", "Admission", "Caller"]

Spawn = Callable[[Coroutine[Any, Any, Any]], None]

CALLER: ContextVar[Caller] = ContextVar("undertow_caller")
NO_CALLER = Caller()  # a generation nobody set `CALLER` for (tests, tools): group "", present
# How often waiting calls' clients are checked, and healthy engines looked for (an engine
# the health checks bring back); a slot that frees admits the next waiter at once.
CLIENT_CHECK_INTERVAL_S = 0.1
NO_ENGINE = ("no healthy engine to generate on; add one with POST /admin/engines or wait "
             "for one to recover")
SHUTTING_DOWN = "the gateway is shutting down; retry once it is back"


class Admission:
    """The pause gate, the router's decisions, the admission queue, and each engine's
    attempts in flight."""

    def __init__(self, router: Router, fleet: Fleet, metrics: GatewayMetrics,
                 resume_timeout_s: float, spawn: Spawn) -> None:
        self.router = router
        self.fleet = fleet
        self.metrics = metrics
        self.resume_timeout_s = resume_timeout_s
        self.queue = AdmissionQueue()
        self._spawn = spawn
        self._gate = asyncio.Event()
        self._gate.set()
        self._started: set[str] = set()  # sessions that had an attempt admitted
        self._watching = False
        self._closed = False

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    def close_gate(self) -> None:
        """New attempts wait from now on (those already admitted run on)."""
        self._gate.clear()

    async def open_gate(self) -> None:
        self._gate.set()
        self.admit_waiting()
        await self.fleet.notify()

    async def admit(self, session_id: str, token_ids: Sequence[int], rid: str, *,
                    admitted: bool, waits: bool) -> Attempt:
        """Routes and registers the attempt (no await between the two, so that admission
        bounds hold). A first attempt waits its turn in the queue while every engine is
        at its bound or the pool is paused. A generation `admitted` before (a resume)
        skips the bounds and the queue; one that `waits` (the consumer has seen tokens)
        waits up to `resume_timeout_s` for a healthy engine instead of failing at once."""
        if admitted:
            return await self._admit_resume(session_id, token_ids, rid, waits)
        if self._closed:
            raise PoolUnavailable(SHUTTING_DOWN)
        wait_s = self.router.config.admission_wait_s
        while wait_s <= 0 and self.paused:  # the refusal policy: no queue, a pause waits
            await self._gate.wait()
        if not self.queue and self._gate.is_set():
            decision = self.router.route(session_id, token_ids, self._loads())
            if decision.engine_id is not None:
                return self._register(self._engine(decision.engine_id), session_id,
                                      token_ids, rid)
            if decision.reason != "busy":
                raise PoolUnavailable(NO_ENGINE)
            if wait_s <= 0:
                self.metrics.admission_refusals.inc()
                raise PoolBusy(decision.retry_after_s)
        return await self._wait_turn(session_id, token_ids, rid, wait_s)

    async def _admit_resume(self, session_id: str, token_ids: Sequence[int], rid: str,
                            waits: bool) -> Attempt:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.resume_timeout_s
        while True:
            await self._gate.wait()
            decision = self.router.route(session_id, token_ids, self._loads(), bounded=False)
            if decision.engine_id is not None and self._gate.is_set():
                return self._register(self._engine(decision.engine_id), session_id,
                                      token_ids, rid)
            if decision.engine_id is not None:
                continue
            if not waits:
                raise PoolUnavailable(NO_ENGINE)
            if loop.time() >= deadline:
                raise PoolUnavailable(f"no healthy engine to resume generation {rid} on "
                                      f"within {self.resume_timeout_s} s")
            await self.fleet.wait_for_change(deadline - loop.time())

    async def _wait_turn(self, session_id: str, token_ids: Sequence[int], rid: str,
                         wait_s: float) -> Attempt:
        """Queues the attempt and waits until a freed slot admits it (its attempt comes
        registered), its wait runs out (`PoolBusy`; restarted while the pool is paused),
        its client leaves (`CallerLeft`) or the pool fails it (`PoolUnavailable`)."""
        now = asyncio.get_running_loop().time()
        lane = "later" if session_id in self._started else "first"
        waiter = Waiter(session_id, token_ids, rid, CALLER.get(NO_CALLER), lane, now,
                        now + wait_s)
        self.queue.add(waiter)
        self.metrics.admission_waiting.set(self.queue.num_waiting)
        self._watch()
        self.admit_waiting()  # the gate may be open with room: waiters ahead go first
        outcome = "admitted"
        try:
            while True:
                try:
                    async with asyncio.timeout_at(waiter.deadline_s):
                        return await asyncio.shield(waiter.future)
                except TimeoutError:
                    if waiter.future.done():
                        return waiter.future.result()
                    if self.paused:
                        waiter.deadline_s = asyncio.get_running_loop().time() + wait_s
                        continue
                    outcome = "refused"
                    self.metrics.admission_refusals.inc()
                    raise PoolBusy(self.router.config.retry_after_s, waited_s=wait_s) from None
        except CallerLeft:
            outcome = "left"
            raise
        except PoolUnavailable:
            outcome = "failed"
            raise
        except asyncio.CancelledError:
            outcome = "left"
            if waiter.future.done() and not waiter.future.exception():
                self.end(waiter.future.result())  # admitted as the caller was cancelled
            raise
        finally:
            self._leave(waiter, outcome)

    def _leave(self, waiter: Waiter, outcome: str) -> None:
        if self.queue.discard(waiter):
            waiter.future.cancel()
        elif not waiter.future.cancelled():
            waiter.future.exception()  # retrieved, whoever set it (no 'never retrieved')
        self.metrics.admission_waiting.set(self.queue.num_waiting)
        waited_s = asyncio.get_running_loop().time() - waiter.enqueued_s
        self.metrics.admission_wait_s.observe(waited_s, outcome=outcome)

    def admit_waiting(self) -> None:
        """Admits waiting calls, in the queue's order, while the router finds room; fails
        them all when no healthy engine is left (as a new call would be)."""
        while self.queue and self._gate.is_set():
            waiter = self.queue.next()
            assert waiter is not None  # the queue is not empty
            decision = self.router.route(waiter.session_id, waiter.token_ids, self._loads())
            if decision.engine_id is None:
                if decision.reason != "busy":
                    self.fail_waiting(NO_ENGINE)
                return
            self.queue.pop(waiter)
            waiter.future.set_result(self._register(self._engine(decision.engine_id),
                                                    waiter.session_id, waiter.token_ids,
                                                    waiter.rid))

    def fail_waiting(self, why: str) -> None:
        """Every waiting call ends with `PoolUnavailable(why)`, a 503 (no healthy engine,
        the pool closes); each its own error, as each is raised in its own task."""
        for waiter in self.queue:
            self.queue.discard(waiter)
            waiter.future.set_exception(PoolUnavailable(why))

    def close(self) -> None:
        """The pool closes: waiting calls fail, and new ones are refused (503)."""
        self._closed = True
        self.fail_waiting(SHUTTING_DOWN)

    def _watch(self) -> None:
        if not self._watching:
            self._watching = True
            self._spawn(self._watch_waiters())

    async def _watch_waiters(self) -> None:
        """While calls wait: those whose client left leave the queue, and an engine that
        came back (the fleet's health checks) gets waiters."""
        try:
            while self.queue:
                await asyncio.sleep(CLIENT_CHECK_INTERVAL_S)
                for waiter in self.queue:
                    if not waiter.caller.present():
                        self.queue.discard(waiter)
                        waiter.future.set_exception(CallerLeft(
                            "the client closed its connection while the call waited for "
                            "admission"))
                self.admit_waiting()
        finally:
            self._watching = False

    def _engine(self, engine_id: str) -> EngineRecord:
        engine = self.fleet.get(engine_id)
        assert engine is not None  # the router routes to the fleet's engines only
        return engine

    def _register(self, engine: EngineRecord, session_id: str, token_ids: Sequence[int],
                  rid: str) -> Attempt:
        self.router.assign(session_id, engine.engine_id, token_ids)
        self._started.add(session_id)
        attempt = Attempt(rid, engine, session_id=session_id, token_ids=token_ids)
        engine.attempts.add(attempt)
        self.metrics.engine_generations.inc(engine=engine.engine_id)
        self.fleet.publish_load(engine)
        return attempt

    def end(self, attempt: Attempt) -> None:
        """The attempt no longer counts as in flight on its engine (idempotent); its slot
        goes to the next waiting call."""
        if attempt in attempt.engine.attempts:
            attempt.engine.attempts.discard(attempt)
            self.fleet.publish_load(attempt.engine)
            self.admit_waiting()
            if self.fleet.has_waiters:  # a pause, drain or removal waits on the change
                self._spawn(self.fleet.notify())

    def forget_session(self, session_id: str) -> None:
        """The session closed: a call it makes later is a first call again."""
        self._started.discard(session_id)

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
        router forgets the sessions pinned to it; waiting calls fail when no healthy
        engine is left."""
        if await self.fleet.mark_dead(engine, why):
            self.router.forget_engine(engine.engine_id)
            self.admit_waiting()

    def _loads(self) -> list[EngineLoad]:
        return [EngineLoad(e.engine_id, e.state, len(e.attempts)) for e in self.fleet.engines]
