"""The run's one loop: finished groups in, new weight versions out (sync; docs/design.md,
data flow step 6).

Every `undertow train` runs this loop, with or without a `pool` section. The run is a pool
of cells: with a `pool` section, `pool.num_cells` cells that the policy moves between rollout
and training (`learner/pool/`, carried out by `elastic.local.LocalPool`); without one, the
pool is one rollout cell that never moves and the learner trains in its own process
(`one_cell`). The loop runs in the learner's (main) thread and repeats three things until
the last step is published:

1. Collect: wait up to `POLL_S` for finished groups, pass each through the one
   `Admission` (`admission.py`), and count the closed sessions of the others (the
   gateway's session list), so that w(t) of the waterlevel rule moves per session.
2. Decide: snapshot the pool (each rollout cell's live sessions, each unpublished
   batch's progress) -> the policy (`pool/policy.py`, the code the simulator runs) -> carry
   out its decisions: `DispatchBatch(s)` launches the groups of step s on the group
   source; `MoveToTraining(c)` drains c's engine at the gateway and starts c's learner
   member; `StartTraining(s)` opens step s; after a publish, `MoveToRollout(c)` stops c's
   member and serves the new weights on c. The one-cell pool's policy only dispatches
   (within `learner.max_staleness`) and starts steps.
3. Stream: once the pool has started step s, `learner.open_step` opens it and every group
   of s that finishes from then on goes to `learner.add_group` at once: the elastic
   learner (`elastic/learner.py`) appends it to the step its members are training, the
   plain learner (`train.py`) checks it holds a trainable token. When the last group is
   in, `learner.train_step` finishes the step (the gradient, clipping, AdamW); then the
   weights are written (a checkpoint every `learner.checkpoint_every` steps), pushed to the
   engines as the next weight version, and the step is published with one metrics line
   (`metrics_log.py`), handed to `on_step` (the progress line, the trackers).

Where groups come from and where weights go are two small protocols (`train.py`):
`GroupSource.launch(request)` / `wait(timeout_s)` and `WeightSink.push(model_dir,
weight_version)`; the rollout side's session counts are `RolloutSide`.

Steps and groups: step s holds `groups_per_step` launch indices. Groups finish in any
order: a finished group of a later step takes the place of an unfinished one of the
oldest unpublished step (`_promote`), which takes its place in the later step, so a slow
group never holds a step while others wait. Staleness: the policy dispatches step s only
while the published weights are at most its `max_staleness` steps behind s; a group whose
oldest sampled token is more than `learner.max_staleness` versions older than the step
it is in is dropped and replaced when `learner.drop_stale` (e.g. a session that
straddled several updates, or weights that do not reach the engines).

Only real outcomes train (`admission.py`): a dropped group (fewer than two valid sessions;
with `advantages.filter_uniform_groups`, every reward the same, up to
`advantages.max_extra_groups` per step; no trainable token; stale) leaves its step, and a
replacement (the next launch index) is launched into the same step at once.
`max_failed_groups` groups in a row whose every session Undertow failed stop the run with
one `RunFailedError`; the open step is aborted first, so no member waits on it. No group
finishing for `learner.group_timeout_s` stops the run with a TimeoutError. Each step's
metrics line (and the one line `on_step` prints) counts what it dropped and re-ran; which
groups, and why, go to the run's log (`RUN/train.log`, `run_log.py`).

Every decision is written with its start and end time to `pool_timeline.jsonl` in the
run directory (one JSON object a line), with the step openings and the groups added,
which is how switch costs and roles over time are read back.

Stopping and resuming: when `stop` is set the loop aborts the open step, writes a
checkpoint whose pending groups are the finished groups of every unpublished step, and
returns "stopped". A loop over a restored learner (`Learner.restore`) first rebuilds the
unpublished steps from the checkpoint: their finished groups come back from it, the groups
that were still running are launched again (same launch index, so a deterministic source
repeats them; a new group ID, so the gateway's store keeps both). (The checkpoint does not
say which step a replacement belonged to: the live launch indices are dealt to the steps
in order.)
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
from typing import Any, Protocol

from undertow.learner.admission import Admission, StepCounts, note_drop
from undertow.learner.checkpoint import PendingGroup
from undertow.learner.elastic.local import LocalPool
from undertow.learner.pool.cell import Cell
from undertow.learner.pool.errors import CellPoolError
from undertow.learner.pool.policy import Policy, Split
from undertow.learner.pool.state import BatchProgress, Decision, MoveToRollout
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
    """The run's loop (see the module docstring). Takes over `pool.dispatch`.

    Invariants: `batches` holds the dispatched, unpublished steps, oldest first; the
    learner's `state.step` is the number of published steps, so the open step (if
    any) is `batches[0].step == state.step`; a group is added to the open step once,
    and only to the step it is in; a group moves to another step only while unfinished
    or, finished, before its step is open; every batch holds `groups_per_step` launch
    indices, none of them consumed (a dropped one is consumed and replaced at once).
    """

    def __init__(self, learner: Learner, pool: LocalPool, policy: Policy,
                 source: GroupSource, sink: WeightSink, sessions: RolloutSide,
                 stop: threading.Event | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None):
        self.learner, self.pool, self.policy = learner, pool, policy
        self.source, self.sink, self.sessions = source, sink, sessions
        self.stop = stop or threading.Event()
        self.on_step = on_step or (lambda record: None)
        self.config, self.state = learner.config, learner.state
        self.log = RunLog(learner.run_dir)
        self.admission = Admission(self.config.group_size, self.config.max_failed_groups,
                                   learner.advantage_config, self.log)
        self.batches: list[_Batch] = []
        self.pool.dispatch = self._dispatch
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
                                          training_started=self.pool.open_step == batch.step))
        return tuple(progress)

    def _dispatch(self, step: int) -> None:
        batch = _Batch(step, {}, time.perf_counter())
        for _ in range(self.config.groups_per_step):
            self._launch_next(batch)
        self.batches.append(batch)

    def _launch_next(self, batch: _Batch) -> int:
        """Launches the next launch index into `batch`; returns it."""
        index = self.state.num_launched
        self.state.num_launched += 1
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
        self.learner.pending = []

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
            reason = self.admission.admit(group, batch.counts, batch.step + 1)
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
            closed = self.sessions.num_closed(waiting)
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
        if not self.batches or self.pool.open_step != self.batches[0].step:
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
        self.learner.pending = self._pending()
        model_dir = self.learner.save(self._is_checkpoint_step())
        self.sink.push(model_dir, self.state.step)
        self.pool.step_published(batch.step)
        open_s = time.perf_counter() - (batch.opened_s or batch.dispatched_s)
        values.update(rollout_s=rollout_s, train_s=train_s,
                      sync_s=time.perf_counter() - sync_started_s,
                      step_s=time.perf_counter() - batch.dispatched_s,
                      staleness_mean=sum(staleness) / len(staleness),
                      staleness_max=max(staleness), **batch.counts.metrics())
        self.on_step(self.learner.metrics.append(self.state.step, self.state.step, values))
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
        self.learner.pending = self._pending()
        self.learner.save(checkpoint=True)
        self._record({"event": "stopped", "step": self.state.step,
                      "pending": [group.index for group in self.learner.pending]})

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


class _FixedEngine:
    """The one cell's engine slots: the engine serves throughout, nothing moves."""

    def drain(self, cell_id: int) -> None:
        raise CellPoolError("the one-cell pool never moves its cell to training")

    def serve(self, cell_id: int, weight_version: int) -> None:
        raise CellPoolError("the one-cell pool never moves its cell to training")


class _NoMembers:
    """The one cell's member slots: the learner trains in its own process."""

    def start(self, cell_id: int) -> None:
        raise CellPoolError("the one-cell pool has no learner members")

    def join(self, cell_id: int, step: int) -> None:
        self.start(cell_id)

    def stop(self, cell_id: int) -> None:
        self.start(cell_id)


class OneEngine:
    """The rollout side of the one-cell pool, whose policy reads no session counts."""

    def num_sessions(self) -> dict[int, int]:
        return {}

    def num_closed(self, group_ids: list[str]) -> dict[str, int]:
        return {}

    def prepare(self, cell_ids: list[int]) -> None:
        return None


def one_cell(learner: Learner) -> tuple[LocalPool, Policy]:
    """The pool of a run without a `pool` section: one rollout cell that never moves,
    and a policy that dispatches steps within `learner.max_staleness` and starts each as
    soon as it can (`Split` with no training cell: the learner's own process trains)."""
    pool = LocalPool([Cell(0)], _FixedEngine(), _NoMembers(), weight_version=learner.state.step)
    return pool, Split(num_training_cells=0, max_staleness=learner.config.max_staleness)


def train_alone(learner: Learner, source: GroupSource, sink: WeightSink,
                stop: threading.Event | None = None,
                on_step: Callable[[dict[str, Any]], None] | None = None) -> str:
    """Runs `learner` on the one-cell pool; returns "done" or "stopped"."""
    pool, policy = one_cell(learner)
    return RunLoop(learner, pool, policy, source, sink, OneEngine(), stop, on_step).run()
