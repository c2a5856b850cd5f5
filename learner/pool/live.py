"""`undertow train` with a cell pool: the policy moves cells, the elastic learner trains.

The loop runs in the learner's (main) thread and repeats three things until the last
step is published:

1. Decide: snapshot the pool (each rollout cell's live sessions, each unpublished
   batch's progress) -> the policy (`policy.py`, the code the simulator runs) -> carry
   out its decisions with `LocalPool`: `DispatchBatch(s)` launches the groups of step s
   on the group source; `MoveToTraining(c)` drains c's engine at the gateway (its
   sessions move, its in-flight generations resume elsewhere) and starts c's learner
   member; `StartTraining(s)` sends every training cell's member into step s; after a
   publish, `MoveToRollout(c)` stops c's member and serves the new weights on c.
2. Wait up to `POLL_S` for finished groups, and count the closed sessions of the others
   (the gateway's session list), so that w(t) of the waterlevel rule moves per session.
3. Train: once every group of the open step has finished, `ElasticLearner.train_step`
   packs the step and runs its backward pass through the elastic `Coordinator`: the
   members on the training cells compute the gradient (however many joined), this
   process clips it and steps the optimizer; then the weights are pushed and the step
   is published.

Members wait inside the step (`Member.join`) from `StartTraining` until the step opens,
which is when its last group has finished: the packed step, and with it every loss
normaliser, is only known then (`elastic.py`). So a cell that moves early saves its
engine start-up and its member's model load from the critical path, not training time.

Every decision is written with its start and end time to `pool_timeline.jsonl` in the
run directory (one JSON object a line), which is how switch costs and roles over time
are read back. Resuming a pool run is not supported (the run refuses `--resume`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from undertow.learner.checkpoint import PendingGroup
from undertow.learner.elastic import Coordinator, ElasticStepResult
from undertow.learner.packing import PackedStep
from undertow.learner.pool.local import LocalPool
from undertow.learner.pool.policy import Policy
from undertow.learner.pool.state import BatchProgress, Decision, MoveToRollout
from undertow.learner.train import GroupRequest, GroupSource, Learner, WeightSink, group_id_of
from undertow.learner.trees import group_staleness

POLL_S = 0.5
MAX_ROUNDS_PER_DECIDE = 16


class RolloutSide(Protocol):
    """The rollout side as the loop sees it: sessions per rollout cell, closed sessions
    per group, and starting several cells' engines at once ahead of `serve`."""

    def num_sessions(self) -> dict[int, int]:
        """Live sessions pinned to each rollout cell's engine."""
        ...

    def num_closed(self, group_ids: list[str]) -> dict[str, int]:
        """Closed sessions of each group (a group named `g` or `g.<task>`)."""
        ...

    def prepare(self, cell_ids: list[int]) -> None: ...


class ElasticLearner(Learner):
    """A `Learner` whose backward pass is one elastic step (`elastic.Coordinator`).

    The members on the training cells compute the step's gradient and the coordinator
    sums it into this process's `.grad`; clipping, the optimizer and the weights stay
    here. Members do not compute the behaviour-KL and entropy sums that the plain
    learner logs, so `train_step` reports those as None.
    """

    coordinator: Coordinator
    last_result: ElasticStepResult | None = None

    def _backward(self, step: PackedStep) -> dict[str, float]:
        self.coordinator.open_step(self.state.step, step, self.loss)
        self.last_result = self.coordinator.finish_step()
        stats = self.last_result.stats
        return {"loss": stats.get("loss", 0.0), "num_terms": stats.get("num_terms", 0.0),
                "num_clipped": stats.get("num_clipped", 0.0), "kl_sum": 0.0,
                "entropy_sum": 0.0, "kl_ref_sum": stats.get("kl_sum", 0.0)}

    def train_step(self, trees) -> dict[str, Any]:
        values = super().train_step(trees)
        values.update(kl=None, entropy=None, num_members=len(self.last_result.ranks) - 1)
        return values


@dataclass
class _Batch:
    """One dispatched step: its groups by launch index, and what has finished."""

    step: int
    group_ids: dict[int, str]
    dispatched_s: float
    finished: dict[int, PendingGroup] = field(default_factory=dict)
    num_closed: dict[str, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.group_ids)


class PoolLoop:
    """The loop of a pool run (see the module docstring). Takes over `pool.dispatch`.

    Invariants: `batches` holds the dispatched, unpublished steps, oldest first; the
    learner's `state.step` is the number of published steps, so the open step (if
    any) is `batches[0].step == state.step`.
    """

    def __init__(self, learner: ElasticLearner, pool: LocalPool, policy: Policy,
                 source: GroupSource, sink: WeightSink, sessions: RolloutSide,
                 stop: threading.Event | None = None):
        self.learner, self.pool, self.policy = learner, pool, policy
        self.source, self.sink, self.sessions = source, sink, sessions
        self.stop = stop or threading.Event()
        self.config, self.state = learner.config, learner.state
        self.batches: list[_Batch] = []
        self.pool.dispatch = self._dispatch
        self.timeline_path = Path(learner.run_dir) / "pool_timeline.jsonl"
        self.started_s = time.perf_counter()

    def run(self) -> str:
        """Trains until `num_steps` are published ("done") or `stop` is set ("stopped")."""
        self._record({"event": "start", "cells": self._roles()})
        while self.state.step < self.config.num_steps:
            if self.stop.is_set():
                return "stopped"
            self._collect()
            self._decide()
            if self.batches and self.pool.open_step == self.batches[0].step \
                    and self.batches[0].complete:
                self._train(self.batches.pop(0))
        return "done"  # no last decision: cells would only go back to serve nothing

    def _decide(self) -> None:
        for _ in range(MAX_ROUNDS_PER_DECIDE):
            self.pool.update_sessions(self.sessions.num_sessions())
            decisions = self.policy.decide(self.pool.snapshot(self._progress(),
                                                              self.config.num_steps))
            if not decisions:
                return
            returning = [d.cell_id for d in decisions if isinstance(d, MoveToRollout)]
            if len(returning) > 1:
                begun_s = self._now()
                self.sessions.prepare(returning)
                self._record({"event": "PrepareEngines", "cell_ids": returning,
                              "begun_s": begun_s, "cells": self._roles()})
            for decision in decisions:
                begun_s = self._now()
                self.pool.carry_out([decision])
                self._record({"event": type(decision).__name__, **_fields(decision),
                              "begun_s": begun_s, "cells": self._roles()})

    def _progress(self) -> tuple[BatchProgress, ...]:
        group_size = self.config.group_size
        progress = []
        for batch in self.batches:
            num_finished = sum(group_size if index in batch.finished else
                               min(batch.num_closed.get(group_id, 0), group_size)
                               for index, group_id in batch.group_ids.items())
            num_sessions = len(batch.group_ids) * group_size
            progress.append(BatchProgress(batch.step, num_sessions, num_sessions, num_finished,
                                          training_started=self.pool.open_step == batch.step))
        return tuple(progress)

    def _dispatch(self, step: int) -> None:
        gps = self.config.groups_per_step
        batch = _Batch(step, {}, time.perf_counter())
        for index in range(step * gps, (step + 1) * gps):
            request = GroupRequest(index=index, group_id=group_id_of(index, 0),
                                   group_size=self.config.group_size,
                                   weight_version=self.state.step)
            self.source.launch(request)
            batch.group_ids[index] = request.group_id
        self.state.num_launched = max(self.state.num_launched, (step + 1) * gps)
        self.batches.append(batch)

    def _collect(self) -> None:
        by_step = {batch.step: batch for batch in self.batches}
        gps = self.config.groups_per_step
        for group in self.source.wait(timeout_s=POLL_S):
            by_step[group.index // gps].finished[group.index] = PendingGroup(
                group.index, group.tree, group.rollout_s)
        waiting = [group_id for batch in self.batches for index, group_id in
                   batch.group_ids.items() if index not in batch.finished]
        if waiting:
            closed = self.sessions.num_closed(waiting)
            for batch in self.batches:
                batch.num_closed.update({g: closed.get(g, 0) for g in batch.group_ids.values()})

    def _train(self, batch: _Batch) -> None:
        groups = [batch.finished[index] for index in sorted(batch.finished)]
        rollout_s = max(g.rollout_s for g in groups)
        staleness = [group_staleness(g.tree, self.state.step) for g in groups]
        train_started_s = time.perf_counter()
        values = self.learner.train_step([g.tree for g in groups])
        train_s = time.perf_counter() - train_started_s
        self.state.consumed.extend(g.index for g in groups)
        sync_started_s = time.perf_counter()
        model_dir = self.learner.save(self._is_checkpoint_step())
        self.sink.push(model_dir, self.state.step)
        self.pool.step_published(batch.step)
        values.update(rollout_s=rollout_s, train_s=train_s,
                      sync_s=time.perf_counter() - sync_started_s,
                      step_s=time.perf_counter() - batch.dispatched_s,
                      staleness_mean=sum(staleness) / len(staleness),
                      staleness_max=max(staleness), num_dropped_groups=0)
        self.learner.metrics.append(self.state.step, self.state.step, values)
        self._record({"event": "published", "step": batch.step,
                      "weight_version": self.state.step, "num_members": values["num_members"],
                      "cells": self._roles()})

    def _is_checkpoint_step(self) -> bool:
        step = self.state.step
        return step % self.config.checkpoint_every == 0 or step == self.config.num_steps

    def _roles(self) -> dict[str, str]:
        return {str(i): cell.role.value for i, cell in sorted(self.pool.cells.items())}

    def _now(self) -> float:
        return round(time.perf_counter() - self.started_s, 3)

    def _record(self, event: dict[str, Any]) -> None:
        with open(self.timeline_path, "a") as handle:
            handle.write(json.dumps({"t_s": self._now(), **event}) + "\n")


def _fields(decision: Decision) -> dict[str, int]:
    return dataclasses.asdict(decision)


def read_timeline(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events a pool run wrote to `pool_timeline.jsonl`, in order."""
    path = Path(run_dir) / "pool_timeline.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
