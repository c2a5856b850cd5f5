"""The run's one loop: finished groups in, new weight versions out, over any `Pool`
(`protocol.py`), in the learner's thread. docs/design.md, "From `undertow train` to the
loss", step 6; what it does each round, how groups move between steps, staleness, dropped
groups, the timeline and resuming: docs/cluster.md, "How the cell pool runs".

Limits enforced here: no group finishing for `learner.group_timeout_s` stops the run with
a TimeoutError; `max_failed_groups` groups in a row whose every session Undertow failed
stop it with one `RunFailedError` (`GroupFilter`), the open step aborted first so that no
member waits on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undertow.cells.one_cell import OneCell
from undertow.cells.protocol import Pool
from undertow.cells.state import BatchProgress, Decision, DispatchBatch, MoveToRollout
from undertow.learner.checkpoint import PendingGroup
from undertow.learner.group_filter import GroupFilter, StepCounts, note_drop
from undertow.learner.metrics_log import MetricsLog
from undertow.learner.run_log import RunLog
from undertow.learner.train import (
    FinishedGroup,
    GroupRequest,
    GroupSource,
    Learner,
    WeightSink,
    group_id_of,
)
from undertow.learner.trees import group_staleness

POLL_S = 0.5
MAX_ROUNDS_PER_DECIDE = 16


@dataclass
class _Batch:
    """One dispatched step: its groups by launch index (a dropped group leaves, its
    replacement comes in), those finished and admitted (in the order they finished),
    those added to the open elastic step, and what the step dropped and re-ran."""

    step: int
    group_ids: dict[int, str]
    dispatched_s: float
    finished: dict[int, PendingGroup] = field(default_factory=dict)
    num_closed: dict[str, int] = field(default_factory=dict)
    added: set[int] = field(default_factory=set)
    opened_s: float | None = None
    counts: StepCounts = field(default_factory=StepCounts)

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.group_ids)


class RunLoop:
    """The run's loop (see the module docstring) over `pool` (`protocol.Pool`); its
    learner's metrics lines go to `metrics` (default `learner.metrics`).

    Invariants: `batches` holds the dispatched, unpublished steps, oldest first; the
    learner's `state.step` is the number of published steps, so the open step (if
    any) is `batches[0].step == state.step`; a group is added to the open step once,
    and only to the step it is in; a group moves to another step only while unfinished
    or, finished, before its step is open; every batch holds `groups_per_step` launch
    indices, none of them consumed (a dropped one is consumed and replaced at once).
    """

    def __init__(self, learner: Learner, pool: Pool, source: GroupSource,
                 stop: threading.Event | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 metrics: MetricsLog | None = None):
        self.learner, self.pool, self.source = learner, pool, source
        self.stop = stop or threading.Event()
        self.on_step = on_step or (lambda record: None)
        self.metrics = metrics or learner.metrics
        self.config, self.state = learner.config, learner.state
        self.log = RunLog(learner.run_dir)
        self.group_filter = GroupFilter(self.config.group_size, self.config.max_failed_groups,
                                        learner.advantage_config, self.log)
        self.batches: list[_Batch] = []
        self.timeline_path = Path(learner.run_dir) / "pool_timeline.jsonl"
        self.started_s = time.perf_counter()
        self.last_progress_s = time.monotonic()

    def run(self) -> str:
        """Trains until `num_steps` are published ("done") or `stop` is set ("stopped")."""
        self._record({"event": "start", "step": self.state.step, "cells": self._roles()})
        self._restore_batches()
        try:
            while self.state.step < self.config.num_steps:
                if self.stop.is_set():
                    self._save_stopped()
                    return "stopped"
                self._collect()
                self._decide()
                self._stream()
        except BaseException:   # e.g. RunFailedError: members must not wait on the step
            with contextlib.suppress(Exception):
                self.learner.abort_step()
            raise
        return "done"  # no last decision: cells would only go back to serve nothing

    def _decide(self) -> None:
        for _ in range(MAX_ROUNDS_PER_DECIDE):
            roles = self.pool.roles
            roles.update_sessions(self.pool.num_sessions())
            decisions = self.pool.policy.decide(roles.snapshot(self._progress(),
                                                               self.config.num_steps))
            if not decisions:
                return
            returning = [d.cell_id for d in decisions if isinstance(d, MoveToRollout)]
            if len(returning) > 1:
                begun_s = self._now()
                self.pool.prepare(returning)
                self._record({"event": "PrepareEngines", "cell_ids": returning,
                              "begun_s": begun_s, "cells": self._roles()})
            for decision in decisions:
                begun_s = self._now()
                if isinstance(decision, DispatchBatch):
                    self._dispatch(decision.step)
                else:
                    roles.carry_out([decision])
                self._record({"event": type(decision).__name__, **_fields(decision),
                              "begun_s": begun_s, "cells": self._roles()})

    def _progress(self) -> tuple[BatchProgress, ...]:
        """Each batch's sessions for the policy. A group counts as finished only once it
        is collected and admitted: until then one of its sessions stays outstanding,
        however many are closed, so the waterlevel rule keeps a rollout cell for the
        replacement a dropped group needs."""
        group_size = self.config.group_size
        progress = []
        for batch in self.batches:
            num_finished = sum(group_size if index in batch.finished else
                               min(batch.num_closed.get(group_id, 0), group_size - 1)
                               for index, group_id in batch.group_ids.items())
            num_sessions = len(batch.group_ids) * group_size
            progress.append(BatchProgress(batch.step, num_sessions, num_sessions, num_finished,
                                          training_started=self.pool.roles.open_step == batch.step))
        return tuple(progress)

    def _dispatch(self, step: int) -> None:
        batch = _Batch(step, {}, time.perf_counter())
        for _ in range(self.config.groups_per_step):
            self._launch_next(batch)
        self.batches.append(batch)

    def _launch_next(self, batch: _Batch) -> int:
        """Launches the next launch index into `batch`; returns it."""
        index = self.state.launch()
        batch.group_ids[index] = self._launch(index)
        return index

    def _launch(self, index: int) -> str:
        request = GroupRequest(index=index, group_id=group_id_of(index, self.state.num_resumes),
                               group_size=self.config.group_size,
                               weight_version=self.state.step)
        self.source.launch(request)
        return request.group_id

    def _restore_batches(self) -> None:
        """The unpublished steps of a restored learner (none for a new run): the live
        launch indices (launched, not consumed) dealt to them in order, finished groups
        from the checkpoint, the others launched again."""
        gps = self.config.groups_per_step
        pending = {group.index: group for group in self.learner.pending}
        consumed = set(self.state.consumed)
        live = [i for i in range(self.state.num_launched) if i not in consumed]
        for number, step in enumerate(range(self.state.step,
                                             self.state.step + -(-len(live) // gps))):
            batch = _Batch(step, {}, time.perf_counter())
            for index in live[number * gps:(number + 1) * gps]:
                if index in pending:
                    batch.group_ids[index] = pending[index].tree.group_id
                    batch.finished[index] = pending[index]
                else:
                    batch.group_ids[index] = self._launch(index)
            self.batches.append(batch)
            self._record({"event": "restored", "step": step,
                          "finished": sorted(batch.finished), "group_ids": batch.group_ids})

    def _collect(self) -> None:
        """Admits (or drops and replaces) the groups finished since, moves them to the
        oldest unfinished step, and counts the closed sessions of those still running."""
        groups = self.source.wait(timeout_s=POLL_S)
        if groups:
            self.last_progress_s = time.monotonic()
        elif time.monotonic() - self.last_progress_s > self.config.group_timeout_s:
            raise TimeoutError(f"no group finished within learner.group_timeout_s="
                               f"{self.config.group_timeout_s}; are the rollouts running?")
        for group in groups:
            batch = next((b for b in self.batches if group.index in b.group_ids), None)
            if batch is None:   # not of an unpublished step (launched before a restart)
                continue
            reason = self.group_filter.admit(group, batch.counts, batch.step + 1)
            if reason is None:
                reason = self._stale(group, batch)
            if reason is None:
                batch.finished[group.index] = PendingGroup(group.index, group.tree,
                                                           group.rollout_s)
                self._promote()
            else:
                self._replace(batch, group, reason)
        waiting = [group_id for batch in self.batches for index, group_id in
                   batch.group_ids.items() if index not in batch.finished]
        if waiting:
            closed = self.pool.num_closed(waiting)
            for batch in self.batches:
                batch.num_closed.update({g: closed.get(g, 0) for g in batch.group_ids.values()})

    def _stale(self, group: FinishedGroup, batch: _Batch) -> str | None:
        """"stale" (counted and logged) when `drop_stale` and the group's oldest token
        is more than `max_staleness` versions older than the weights that train it."""
        staleness = group_staleness(group.tree, batch.step)
        if not self.config.drop_stale or staleness <= self.config.max_staleness:
            return None
        note_drop(batch.counts, self.log, batch.step + 1, "stale", f"group {group.tree.group_id}: "
                  f"sampled by weights {staleness} versions old (learner.max_staleness="
                  f"{self.config.max_staleness}; are the weights reaching the engines?)")
        return "stale"

    def _promote(self) -> None:
        """Finished groups of later steps take the places of the oldest step's unfinished
        ones, which take theirs: steps train groups in the order they finish."""
        first = self.batches[0]
        waiting = [index for index in first.group_ids if index not in first.finished]
        for later in self.batches[1:]:
            if later.opened_s is not None:
                continue
            for index in list(later.finished):
                if not waiting:
                    return
                slow = waiting.pop(0)
                first.group_ids[index] = later.group_ids.pop(index)
                first.finished[index] = later.finished.pop(index)
                later.group_ids[slow] = first.group_ids.pop(slow)
                self._record({"event": "GroupMoved", "index": index, "step": first.step,
                              "in_place_of": slow})

    def _replace(self, batch: _Batch, group: FinishedGroup, reason: str) -> None:
        """Drops a group from its step (its index consumed) and launches another."""
        batch.group_ids.pop(group.index)
        self.state.consumed.append(group.index)
        index = self._launch_next(batch)
        self._record({"event": "GroupDropped", "step": batch.step, "index": group.index,
                      "group_id": group.tree.group_id, "reason": reason,
                      "replacement": index})

    def _stream(self) -> None:
        """Opens the step the pool has started, adds its newly finished groups, and
        finishes it once all of them are in."""
        if not self.batches or self.pool.roles.open_step != self.batches[0].step:
            return
        batch = self.batches[0]
        if batch.opened_s is None:
            batch.opened_s = time.perf_counter()
            self.learner.open_step()
            self._record({"event": "StepOpened", "step": batch.step, "cells": self._roles()})
        for index, group in list(batch.finished.items()):
            if index not in batch.added:
                num_micro_batches = self.learner.add_group(group.tree)
                if not num_micro_batches:   # nothing trainable: no term, replaced
                    self._drop_empty(batch, group)
                    continue
                batch.added.add(index)
                self._record({"event": "GroupAdded", "step": batch.step, "index": index,
                              "num_micro_batches": num_micro_batches,
                              "num_groups_left": len(batch.group_ids) - len(batch.added),
                              "num_groups_running": len(batch.group_ids) - len(batch.finished)})
        if batch.complete:
            self._train(self.batches.pop(0))

    def _drop_empty(self, batch: _Batch, group: PendingGroup) -> None:
        del batch.finished[group.index]
        note_drop(batch.counts, self.log, batch.step + 1, "empty", f"group {group.tree.group_id}: "
                  "not trained: no trainable token in its sessions")
        self._replace(batch, FinishedGroup(group.index, group.tree), "empty")

    def _train(self, batch: _Batch) -> None:
        groups = [batch.finished[index] for index in sorted(batch.finished)]
        rollout_s = max(g.rollout_s for g in groups)
        staleness = [group_staleness(g.tree, self.state.step) for g in groups]
        train_started_s = time.perf_counter()
        values = self.learner.train_step([g.tree for g in groups])
        train_s = time.perf_counter() - train_started_s
        self.state.consumed.extend(g.index for g in groups)
        sync_started_s = time.perf_counter()
        model_dir = self.learner.save(self._is_checkpoint_step(), self._pending())
        self.pool.push(model_dir, self.state.step)
        self.pool.roles.step_published(batch.step)
        open_s = time.perf_counter() - (batch.opened_s or batch.dispatched_s)
        values.update(rollout_s=rollout_s, train_s=train_s,
                      sync_s=time.perf_counter() - sync_started_s,
                      step_s=time.perf_counter() - batch.dispatched_s,
                      staleness_mean=sum(staleness) / len(staleness),
                      staleness_max=max(staleness), **batch.counts.metrics())
        self.on_step(self.metrics.append(self.state.step, self.state.step, values))
        self.last_progress_s = time.monotonic()   # the timeout counts rollouts, not training
        self._record({"event": "published", "step": batch.step,
                      "weight_version": self.state.step, **self.learner.last_step,
                      "open_s": round(open_s, 3), "train_s": round(train_s, 3),
                      "cells": self._roles()})

    def _pending(self) -> list[PendingGroup]:
        """The finished groups of the unpublished steps (what a checkpoint keeps)."""
        return [group for batch in self.batches for group in batch.finished.values()]

    def _save_stopped(self) -> None:
        self.learner.abort_step()
        pending = self._pending()
        self.learner.save(checkpoint=True, pending=pending)
        self._record({"event": "stopped", "step": self.state.step,
                      "pending": [group.index for group in pending]})

    def _is_checkpoint_step(self) -> bool:
        step = self.state.step
        return step % self.config.checkpoint_every == 0 or step == self.config.num_steps

    def _roles(self) -> dict[str, str]:
        return {str(i): cell.role.value for i, cell in sorted(self.pool.roles.cells.items())}

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


def train_alone(learner: Learner, source: GroupSource, sink: WeightSink,
                stop: threading.Event | None = None,
                on_step: Callable[[dict[str, Any]], None] | None = None) -> str:
    """Runs `learner` on the one-cell pool pushing to `sink`; returns "done" or "stopped"."""
    pool = OneCell(sink, learner.state.step, learner.config.max_staleness)
    return RunLoop(learner, pool, source, stop, on_step).run()
