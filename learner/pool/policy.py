"""Pool policies: pure functions from a `PoolState` snapshot to a list of decisions.

Three policies, chosen by name from `POLICIES` (the spec is a name or a plain dict such as
`{"name": "split", "num_training_cells": 4}`):

- `colocate`: every cell rolls out the whole batch, waits for its slowest session, then every cell
  trains, then every cell returns to rollout.
- `split`: a fixed number of cells train, the rest roll out; asynchronous within a staleness bound
  (the learner trains step k while the rollout cells generate step k + 1 with older weights).
- `elastic`: QwenGyre's waterlevel rule. All cells start a step in rollout. With
  w(t) = dispatched - finished sessions, C_R(t) the session slots of the rollout cells and C_e
  those of the next cell to move, that cell moves to training when w(t) <= C_R(t) - C_e, i.e.
  when the outstanding sessions fit in the rollout capacity that would remain without it. Cells
  move one at a time (no second move while one is still switching to training); the learner
  trains finished groups as they arrive, on a membership that grows; when the step is published
  every training cell returns to rollout with the new weights.

No policy reads a clock or does I/O, so the live pool and the simulator share them unchanged.
"""

from typing import Any, Protocol

from undertow.learner.pool.cell import Cell, Role
from undertow.learner.pool.errors import PolicyConfigError
from undertow.learner.pool.state import (
    Decision,
    DispatchBatch,
    MoveToRollout,
    MoveToTraining,
    PoolState,
    StartTraining,
)


class Policy(Protocol):
    name: str

    def decide(self, state: PoolState) -> list[Decision]:
        """Decisions to carry out now, in order; [] when nothing should change."""
        ...


def _return_idle_trainers(state: PoolState) -> list[Decision]:
    """Training cells with no step open go back to rollout (they would otherwise idle)."""
    if state.training_open:
        return []
    return [MoveToRollout(cell.cell_id) for cell in state.cells_in(Role.TRAINING)]


def _dispatch_after_publish(state: PoolState) -> list[Decision]:
    """Synchronous dispatch: the next batch only once the previous step is published."""
    if not state.batches and state.next_step < state.num_steps:
        return [DispatchBatch(state.next_step)]
    return []


class Colocate:
    """All cells roll out, then all train. Staleness is always 0."""

    name = "colocate"

    def decide(self, state: PoolState) -> list[Decision]:
        decisions = _return_idle_trainers(state) + _dispatch_after_publish(state)
        if state.batches:
            batch = state.batches[0]
            if batch.complete and not batch.training_started:
                decisions += [MoveToTraining(c.cell_id) for c in state.cells_in(Role.ROLLOUT)]
                decisions.append(StartTraining(batch.step))
        return decisions


class Split:
    """A fixed set of `num_training_cells` cells trains; the others roll out.

    Batch k + 1 is dispatched once batch k has finished generating and the published weights are
    at most `max_staleness` steps behind it (staleness = step - weight version that generated it).
    The learner opens the oldest unpublished step as soon as it is free and trains its groups as
    they finish, so training overlaps the tail of the same batch and the next batch's rollout.
    """

    name = "split"

    def __init__(self, num_training_cells: int = 1, max_staleness: int = 1):
        if num_training_cells < 1:
            raise PolicyConfigError(f"split: num_training_cells={num_training_cells}; "
                                    "give at least 1 (and fewer than the number of cells)")
        if max_staleness < 0:
            raise PolicyConfigError(f"split: max_staleness={max_staleness}; give 0 or more")
        self.num_training_cells = num_training_cells
        self.max_staleness = max_staleness

    def decide(self, state: PoolState) -> list[Decision]:
        if self.num_training_cells >= len(state.cells):
            raise PolicyConfigError(
                f"split: num_training_cells={self.num_training_cells} leaves no rollout cell "
                f"out of {len(state.cells)}; give at most {len(state.cells) - 1}")
        decisions: list[Decision] = []
        num_training = len(state.cells_in(Role.TRAINING) + state.cells_heading_to(Role.TRAINING))
        spare = sorted(state.cells_in(Role.ROLLOUT), key=_move_order)
        decisions += [MoveToTraining(c.cell_id)
                      for c in spare[:max(0, self.num_training_cells - num_training)]]
        last = state.batches[-1] if state.batches else None
        if (state.next_step < state.num_steps and (last is None or last.complete)
                and state.next_step - state.weight_version <= self.max_staleness):
            decisions.append(DispatchBatch(state.next_step))
            if last is None:
                decisions.append(StartTraining(state.next_step))
        if last is not None and not state.training_open:
            decisions.append(StartTraining(state.batches[0].step))
        return decisions


class Elastic:
    """QwenGyre's waterlevel rule (see the module docstring). Staleness is always 0."""

    name = "elastic"

    def decide(self, state: PoolState) -> list[Decision]:
        decisions = _return_idle_trainers(state) + _dispatch_after_publish(state)
        if not state.batches or state.cells_heading_to(Role.TRAINING):
            return decisions
        batch = state.batches[0]
        rollout = state.cells_in(Role.ROLLOUT)
        if not batch.all_dispatched or not rollout:
            return decisions
        cell = min(rollout, key=_move_order)
        capacity = sum(c.num_session_slots for c in rollout)
        if batch.num_outstanding <= capacity - cell.num_session_slots:
            decisions.append(MoveToTraining(cell.cell_id))
            if not batch.training_started:
                decisions.append(StartTraining(batch.step))
        return decisions


def _move_order(cell: Cell) -> tuple[int, int]:
    """The cell to move first: fewest sessions to migrate, then the highest id."""
    return cell.num_sessions, -cell.cell_id


POLICIES: dict[str, type] = {"colocate": Colocate, "split": Split, "elastic": Elastic}


def make_policy(spec: str | dict[str, Any]) -> Policy:
    """A policy from its name or a plain dict `{"name": ..., **parameters}`."""
    params = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = params.pop("name", None)
    if name not in POLICIES:
        raise PolicyConfigError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    try:
        return POLICIES[name](**params)
    except TypeError as error:
        raise PolicyConfigError(f"policy {name!r}: bad parameters {params}: {error}") from None
