"""Pool policies: pure functions from a `PoolState` snapshot to a list of decisions
(`colocate`, `split`, `elastic`; docs/cluster.md, "The policies").
"""

from typing import Any, Protocol

from undertow.cells.cell import Cell, Role
from undertow.cells.errors import PolicyConfigError
from undertow.cells.state import (
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


def _dispatch_within_staleness(state: PoolState, max_staleness: int) -> list[Decision]:
    """The next step, once the previous one is dispatched and the newest weights are at most
    `max_staleness` steps behind it (0: only once every dispatched step is published)."""
    last = state.batches[-1] if state.batches else None
    if (state.next_step < state.num_steps and (last is None or last.all_dispatched)
            and state.next_step - state.weight_version <= max_staleness):
        return [DispatchBatch(state.next_step)]
    return []


def _check_staleness(name: str, max_staleness: int) -> None:
    if max_staleness < 0:
        raise PolicyConfigError(f"{name}: max_staleness={max_staleness}; give 0 or more")


class Colocate:
    """All cells roll out, then all train. Staleness is always 0."""

    name = "colocate"

    def decide(self, state: PoolState) -> list[Decision]:
        decisions = _return_idle_trainers(state) + _dispatch_within_staleness(state, 0)
        if state.batches:
            batch = state.batches[0]
            if batch.complete and not batch.training_started:
                decisions += [MoveToTraining(c.cell_id) for c in state.cells_in(Role.ROLLOUT)]
                decisions.append(StartTraining(batch.step))
        return decisions


class Split:
    """A fixed set of `num_training_cells` cells trains; the others roll out.

    Asynchronous within `max_staleness` (see the module docstring): with the default of 1 the
    learner trains step k while the rollout cells generate the tail of step k and step k + 1 on
    older weights. The learner opens the oldest unpublished step as soon as it is free and trains
    its groups as they finish. With no training cell, no cell ever moves and the learner's own
    process trains: the run without a pool section (`undertow/cells/one_cell.py`).
    """

    name = "split"

    def __init__(self, num_training_cells: int = 1, max_staleness: int = 1):
        if num_training_cells < 0:
            raise PolicyConfigError(f"split: num_training_cells={num_training_cells}; "
                                    "give 0 or more (and fewer than the number of cells)")
        _check_staleness("split", max_staleness)
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
        dispatch = _dispatch_within_staleness(state, self.max_staleness)
        decisions += dispatch
        if not state.training_open and (state.batches or dispatch):
            # With no batch yet, the step to train is the one `dispatch` opens.
            decisions.append(StartTraining(state.batches[0].step if state.batches
                                           else state.next_step))
        return decisions


class Elastic:
    """QwenGyre's waterlevel rule, synchronous or asynchronous (see the module docstring)."""

    name = "elastic"

    def __init__(self, max_staleness: int = 0):
        _check_staleness("elastic", max_staleness)
        self.max_staleness = max_staleness

    def decide(self, state: PoolState) -> list[Decision]:
        if not state.batches:
            return _return_idle_trainers(state) + _dispatch_within_staleness(state, 0)
        dispatch = _dispatch_within_staleness(state, self.max_staleness)
        if dispatch:
            return dispatch  # the next round sees the waterlevel it raises
        outstanding = sum(batch.num_outstanding for batch in state.batches)
        rollout = state.cells_in(Role.ROLLOUT)
        capacity = sum(c.num_session_slots for c in rollout + state.cells_heading_to(Role.ROLLOUT))
        decisions: list[Decision] = []
        if not state.training_open:
            decisions += _return_for_rollout(state, outstanding - capacity)
            if len(decisions) < len(state.cells_in(Role.TRAINING)):
                decisions.append(StartTraining(state.batches[0].step))
        if decisions and isinstance(decisions[0], MoveToRollout):
            return decisions
        if (state.cells_heading_to(Role.TRAINING) or not rollout
                or not state.batches[-1].all_dispatched):
            return decisions
        cell = min(rollout, key=_move_order)
        if outstanding <= capacity - cell.num_session_slots:
            decisions.append(MoveToTraining(cell.cell_id))
            if not state.training_open and not decisions[:-1]:
                decisions.append(StartTraining(state.batches[0].step))
        return decisions


def _return_for_rollout(state: PoolState, num_short: int) -> list[Decision]:
    """Between steps: training cells whose slots the `num_short` unplaced sessions need."""
    decisions: list[Decision] = []
    for cell in sorted(state.cells_in(Role.TRAINING), key=lambda c: c.cell_id):
        if num_short <= 0:
            break
        decisions.append(MoveToRollout(cell.cell_id))
        num_short -= cell.num_session_slots
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
