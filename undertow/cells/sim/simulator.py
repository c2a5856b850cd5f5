"""The discrete-event simulator: cells, engines and a learner, moved by a pool policy.

After every event the simulator builds the same immutable `PoolState` the live pool would, asks
the policy (`undertow.cells.policy`) for decisions and carries them out through the pool's
transition table, so an illegal decision raises here exactly as it would in the live pool.

Events: a turn's generation ends on an engine, a tool call returns, a session hits its time limit,
a cell arrives in its new role, the learner's queue drains, the optimizer step or the weight sync
ends. Moving a cell to training migrates its sessions to the other rollout engines (a generating
one resumes its turn there after `migration_pause_s`; one with no free slot waits at the head of
the queue); sessions then keep their new engine.
"""

import collections
import dataclasses
import heapq
import itertools
import math

from undertow.cells import (
    BatchProgress,
    Cell,
    Decision,
    DispatchBatch,
    MoveToRollout,
    MoveToTraining,
    Policy,
    PoolState,
    Role,
    StartTraining,
    finish_switch,
)
from undertow.cells.cell import change_role
from undertow.cells.errors import CellPoolError
from undertow.cells.sim.results import RoleSpan, SimResult, StepRecord, summarise
from undertow.cells.sim.rollout import SessionRun, SimEngine
from undertow.cells.sim.training import Learner, Phase
from undertow.cells.sim.workload import Workload

MAX_DECISION_ROUNDS = 1000
TOKEN_EPSILON = 1e-6


class SimulationError(CellPoolError, RuntimeError):
    """The policy stalled the run or asked for something the simulated pool cannot do."""


@dataclasses.dataclass
class BatchRun:
    """One step's sessions while they run and train (mutable twin of `BatchProgress`)."""

    step: int
    session_ids: list[int]
    dispatched_s: float
    weight_version: int
    group_left: dict[int, int]
    group_tokens: dict[int, int]
    group_size: int
    num_finished: int = 0
    training_started: bool = False
    buffered_tokens: float = 0.0
    finish_times_s: list[float] = dataclasses.field(default_factory=list)
    num_unique_tokens: int = 0

    @property
    def complete(self) -> bool:
        return self.num_finished == len(self.session_ids)

    def progress(self) -> BatchProgress:
        return BatchProgress(step=self.step, num_sessions=len(self.session_ids),
                             num_dispatched=len(self.session_ids), num_finished=self.num_finished,
                             training_started=self.training_started)


class Simulator:
    """One run: `num_steps` steps of `workload` on `num_cells` cells under `policy`."""

    def __init__(self, workload: Workload, policy: Policy, num_cells: int, num_steps: int,
                 seed: int = 0):
        if num_cells < 1 or num_steps < 1:
            raise ValueError(f"num_cells={num_cells} and num_steps={num_steps} must be >= 1")
        self.workload, self.policy, self.seed = workload, policy, seed
        self.num_cells, self.num_steps = num_cells, num_steps
        slots = workload.engine.num_session_slots
        self.cells = {i: Cell(i, Role.ROLLOUT, num_session_slots=slots) for i in range(num_cells)}
        self.engines = {i: SimEngine(i, workload.engine, 0.0) for i in range(num_cells)}
        self.sessions: dict[int, SessionRun] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.batches: dict[int, BatchRun] = {}
        self.learner = Learner(workload.trainer)
        self.weight_version = 0
        self.now_s = 0.0
        self.rollout_busy_s = 0.0
        self.timeline: list[RoleSpan] = []
        self.records: list[StepRecord] = []
        self._role_since = dict.fromkeys(self.cells, 0.0)
        self._events: list[tuple] = []
        self._order = itertools.count()

    def run(self) -> SimResult:
        handlers = {"gen": self._on_generation, "tool": self._on_tool, "timeout": self._on_timeout,
                    "switch": self._on_switch, "learner": self._on_learner}
        self._decide()
        while self.weight_version < self.num_steps:
            if not self._events:
                raise SimulationError(f"policy {self.policy.name!r} stalled at t={self.now_s:.1f}s "
                                      f"with {self.weight_version}/{self.num_steps} steps done")
            time_s, _, kind, key, version = heapq.heappop(self._events)
            if not self._current(kind, key, version):
                continue
            self.now_s = time_s
            handlers[kind](key)
            self._decide()
        for engine in self.engines.values():
            engine.advance(self.now_s)
            self.rollout_busy_s += engine.busy_s
        for cell_id, cell in self.cells.items():
            self._close_span(cell_id, cell.role)
        return summarise(self)

    # ---- events

    def _push(self, time_s: float, kind: str, key: int, version: int = 0) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), kind, key, version))

    def _current(self, kind: str, key: int, version: int) -> bool:
        if kind == "gen":
            engine = self.engines.get(key)
            return engine is not None and engine.version == version
        if kind == "learner":
            return self.learner.version == version
        return True

    def _schedule_engine(self, engine: SimEngine) -> None:
        finish_s = engine.next_finish_s()
        if math.isfinite(finish_s):
            self._push(max(finish_s, self.now_s), "gen", engine.cell_id, engine.version)

    def _on_generation(self, cell_id: int) -> None:
        engine = self.engines[cell_id]
        for session_id in engine.pop_finished(self.now_s):
            session = self.sessions[session_id]
            session.generating = False
            latency_s = session.complete_turn()
            if latency_s is None:
                self._finish_session(session, timed_out=False)
            else:
                self._push(self.now_s + latency_s, "tool", session_id)
        self._schedule_engine(engine)

    def _on_tool(self, session_id: int) -> None:
        session = self.sessions[session_id]
        if session.done:
            return
        steps = session.turn_steps(self.workload.engine)
        if session.engine_id is None:
            session.pending_steps = steps
        else:
            self._run_turn(session, steps)

    def _on_timeout(self, session_id: int) -> None:
        session = self.sessions[session_id]
        if session.done:
            return
        if session.generating:
            engine = self._engine_of(session)
            engine.stop_generation(session_id, self.now_s)
            session.generating = False
            self._schedule_engine(engine)
        self._finish_session(session, timed_out=True)

    def _on_switch(self, cell_id: int) -> None:
        cell = finish_switch(self.cells[cell_id])
        self._set_role(cell)
        if cell.role is Role.TRAINING:
            self.learner.set_cells(self.learner.num_cells + 1, self.now_s)
            self._schedule_learner()
        else:
            self.engines[cell_id] = SimEngine(cell_id, self.workload.engine, self.now_s)
            self._fill_slots()

    def _on_learner(self, _key: int) -> None:
        self.learner.advance(self.now_s)
        if self.learner.phase is Phase.TRAINING:
            if self.learner.pending_tokens <= TOKEN_EPSILON:
                self.learner.pending_tokens = 0.0
            self._schedule_learner()
        elif self.learner.phase is Phase.OPTIMIZER:
            self.learner.begin(Phase.SYNC, self.now_s)
            self._schedule_learner()
        else:
            self._publish()

    # ---- sessions

    def _engine_of(self, session: SessionRun) -> SimEngine:
        """The engine whose slot `session` holds (it must hold one)."""
        if session.engine_id is None:
            raise RuntimeError(f"session {session.plan.session_id} holds no engine slot")
        return self.engines[session.engine_id]

    def _run_turn(self, session: SessionRun, num_steps: float) -> None:
        engine = self._engine_of(session)
        prefill = session.plan.turns[session.turn_index].prefill_tokens
        engine.start_generation(session.plan.session_id, num_steps,
                                session.context_tokens + prefill, self.now_s)
        session.generating, session.pending_steps = True, None
        self._schedule_engine(engine)

    def _start_session(self, session: SessionRun, engine: SimEngine) -> None:
        session.engine_id = engine.cell_id
        engine.session_ids.add(session.plan.session_id)
        if session.started_s is None:
            session.started_s = self.now_s
            self._push(self.now_s + self.workload.session.time_limit_s, "timeout",
                       session.plan.session_id)
            self._run_turn(session, session.turn_steps(self.workload.engine))
        elif session.pending_steps is not None:
            self._run_turn(session, session.pending_steps)

    def _fill_slots(self) -> None:
        while self.waiting and self.engines:
            engine = max(self.engines.values(), key=lambda e: (e.num_free_slots, -e.cell_id))
            if engine.num_free_slots == 0:
                return
            session = self.sessions[self.waiting.popleft()]
            if not session.done:
                self._start_session(session, engine)

    def _finish_session(self, session: SessionRun, timed_out: bool) -> None:
        session.finished_s, session.timed_out = self.now_s, timed_out
        if session.engine_id is not None:
            self.engines[session.engine_id].session_ids.discard(session.plan.session_id)
        batch = self.batches[session.plan.step]
        batch.num_finished += 1
        batch.finish_times_s.append(self.now_s)
        self._release_tokens(batch, session)
        if batch.complete:
            self._schedule_learner()
        self._fill_slots()

    def _release_tokens(self, batch: BatchRun, session: SessionRun) -> None:
        """Hand the learner what became trainable when `session` ended (see TrainerModel)."""
        group = session.plan.group
        first_of_group = batch.group_left[group] == batch.group_size
        batch.group_left[group] -= 1
        batch.group_tokens[group] += session.num_tokens
        prompt = self.workload.session.prompt_tokens
        if self.workload.trainer.train_unit == "session":
            tokens = session.num_tokens + (prompt if first_of_group else 0)
        elif batch.group_left[group] == 0:
            tokens = prompt + batch.group_tokens[group]
        else:
            return
        batch.num_unique_tokens += tokens
        if self.learner.step == batch.step:
            self.learner.add_tokens(tokens, self.now_s)
            self._schedule_learner()
        else:
            batch.buffered_tokens += tokens

    # ---- learner

    def _schedule_learner(self) -> None:
        learner = self.learner
        if learner.phase in (Phase.OPTIMIZER, Phase.SYNC):
            assert learner.phase_ends_s is not None, "`begin` set it"
            # Re-armed after every change, since each change retires the learner's old events.
            self._push(learner.phase_ends_s, "learner", 0, learner.version)
            return
        if learner.phase is not Phase.TRAINING:
            return
        assert learner.step is not None, "`open` set it"
        if learner.pending_tokens > 0:
            empty_s = learner.queue_empty_s()
            if empty_s is not None:
                self._push(max(empty_s, self.now_s), "learner", 0, learner.version)
        elif self.batches[learner.step].complete and learner.num_cells:
            learner.begin(Phase.OPTIMIZER, self.now_s)
            self._schedule_learner()

    def _publish(self) -> None:
        step = self.learner.close(self.now_s)
        batch = self.batches.pop(step)
        self.weight_version = step + 1
        timed_out = sum(self.sessions[i].timed_out for i in batch.session_ids)
        self.records.append(StepRecord(
            step=step, dispatched_s=batch.dispatched_s, rollout_done_s=max(batch.finish_times_s),
            published_s=self.now_s, staleness=step - batch.weight_version,
            num_sessions=len(batch.session_ids), num_timed_out=timed_out,
            num_unique_tokens=batch.num_unique_tokens,
            tail_share=_tail_share(batch.dispatched_s, batch.finish_times_s)))

    # ---- decisions

    def snapshot(self) -> PoolState:
        cells = tuple(
            dataclasses.replace(cell, num_sessions=len(self.engines[cell.cell_id].session_ids))
            if cell.role is Role.ROLLOUT else cell for cell in self.cells.values())
        return PoolState(cells=cells, batches=tuple(b.progress() for b in self.batches.values()),
                         weight_version=self.weight_version, num_steps=self.num_steps)

    def _decide(self) -> None:
        for _ in range(MAX_DECISION_ROUNDS):
            decisions = self.policy.decide(self.snapshot())
            if not decisions:
                return
            for decision in decisions:
                self._apply(decision)
        raise SimulationError(f"policy {self.policy.name!r} kept deciding at t={self.now_s:.1f}s "
                              "without reaching a fixed point; its decisions must change the state")

    def _apply(self, decision: Decision) -> None:
        if isinstance(decision, MoveToTraining):
            self._move_to_training(decision.cell_id)
        elif isinstance(decision, MoveToRollout):
            cell = change_role(self.cells[decision.cell_id], Role.SWITCHING, Role.ROLLOUT)
            self._set_role(cell)
            self.learner.set_cells(self.learner.num_cells - 1, self.now_s)
            self._schedule_learner()
            self._push(self.now_s + self.workload.trainer.switch_to_rollout_s, "switch",
                       cell.cell_id)
        elif isinstance(decision, DispatchBatch):
            self._dispatch(decision.step)
        elif isinstance(decision, StartTraining):
            self._start_training(decision.step)
        else:
            raise SimulationError(f"unknown decision {decision!r}")

    def _move_to_training(self, cell_id: int) -> None:
        cell = change_role(self.cells[cell_id], Role.SWITCHING, Role.TRAINING)
        engine = self.engines.pop(cell_id)
        engine.advance(self.now_s)
        self.rollout_busy_s += engine.busy_s
        stranded = []
        for session_id in sorted(engine.session_ids):
            session = self.sessions[session_id]
            remaining = None
            if session.generating:
                pause_steps = self.workload.engine.migration_pause_s / engine.step_s()
                remaining = engine.stop_generation(session_id, self.now_s) + pause_steps
                session.generating = False
            target = max(self.engines.values(), default=None,
                         key=lambda e: (e.num_free_slots, -e.cell_id))
            if target is not None and target.num_free_slots > 0:
                session.engine_id = target.cell_id
                target.session_ids.add(session_id)
                if remaining is not None:
                    self._run_turn(session, remaining)
            else:
                session.engine_id, session.pending_steps = None, remaining
                stranded.append(session_id)
        self.waiting.extendleft(reversed(stranded))
        self._set_role(cell)
        self._push(self.now_s + self.workload.trainer.switch_to_training_s, "switch", cell_id)

    def _dispatch(self, step: int) -> None:
        if step != (max(self.batches) + 1 if self.batches else self.weight_version):
            raise SimulationError(f"policy {self.policy.name!r} dispatched step {step} out of "
                                  "order; steps are dispatched one after another")
        plans = self.workload.sample_batch(self.seed, step)
        groups = {plan.group for plan in plans}
        self.batches[step] = BatchRun(
            step=step, session_ids=[p.session_id for p in plans], dispatched_s=self.now_s,
            weight_version=self.weight_version, group_left=collections.Counter(
                p.group for p in plans), group_tokens=dict.fromkeys(groups, 0),
            group_size=self.workload.group_size)
        for plan in plans:
            self.sessions[plan.session_id] = SessionRun(plan)
        self.waiting.extend(p.session_id for p in plans)
        self._fill_slots()

    def _start_training(self, step: int) -> None:
        batch = self.batches.get(step)
        if batch is None or batch.training_started or step != min(self.batches):
            raise SimulationError(f"policy {self.policy.name!r} started training step {step}, "
                                  "which is not the oldest unstarted step")
        batch.training_started = True
        self.learner.open(step, batch.buffered_tokens, self.now_s)
        self._schedule_learner()

    def _set_role(self, cell: Cell) -> None:
        self._close_span(cell.cell_id, self.cells[cell.cell_id].role)
        self.cells[cell.cell_id] = cell

    def _close_span(self, cell_id: int, role: Role) -> None:
        if self.now_s > self._role_since[cell_id]:
            self.timeline.append(RoleSpan(cell_id, role, self._role_since[cell_id], self.now_s))
        self._role_since[cell_id] = self.now_s


def _tail_share(dispatched_s: float, finish_times_s: list[float]) -> float:
    """The share of the batch's rollout time taken by its last 10% of sessions."""
    times = sorted(finish_times_s)
    duration_s = times[-1] - dispatched_s
    if duration_s <= 0:
        return 0.0
    return (times[-1] - times[int(0.9 * (len(times) - 1))]) / duration_s
