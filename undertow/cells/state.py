"""What a policy sees and what it may say: an immutable snapshot of the pool, and decisions.

The live pool and the simulator both build a `PoolState` after every change (a session finished,
a cell arrived in its new role, a training step ended), ask the policy, and carry out the returned
decisions in order. Neither the snapshot nor the decisions hold clocks, handles or I/O.
"""

import dataclasses

from undertow.cells.cell import Cell, Role


@dataclasses.dataclass(frozen=True)
class BatchProgress:
    """The sessions of one step, from dispatch until the step's weights are published.

    Invariants: `0 <= num_finished <= num_dispatched <= num_sessions`; a session that ran out of
    time counts as finished (it is graded on what it did). `training_started` turns true once,
    when the learner opens this step, and the learner then trains its groups as they finish.
    """

    step: int
    num_sessions: int
    num_dispatched: int = 0
    num_finished: int = 0
    training_started: bool = False

    def __post_init__(self):
        if not 0 <= self.num_finished <= self.num_dispatched <= self.num_sessions:
            raise ValueError(f"step {self.step}: finished={self.num_finished}, dispatched="
                             f"{self.num_dispatched}, sessions={self.num_sessions}; need "
                             "0 <= finished <= dispatched <= sessions")

    @property
    def num_outstanding(self) -> int:
        """w(t) of the waterlevel rule: dispatched minus finished."""
        return self.num_dispatched - self.num_finished

    @property
    def all_dispatched(self) -> bool:
        return self.num_dispatched == self.num_sessions

    @property
    def complete(self) -> bool:
        return self.num_finished == self.num_sessions


@dataclasses.dataclass(frozen=True)
class PoolState:
    """A snapshot of the pool between two changes.

    Invariants: `batches` are the steps dispatched but not yet published, oldest first, with
    consecutive step numbers; at most one of them has `training_started` without being published,
    and it is the oldest; `weight_version` is the number of published steps, so the next step to
    dispatch is `next_step`; the run is over when `weight_version == num_steps`.
    """

    cells: tuple[Cell, ...]
    batches: tuple[BatchProgress, ...] = ()
    weight_version: int = 0
    num_steps: int = 1

    @property
    def next_step(self) -> int:
        return self.batches[-1].step + 1 if self.batches else self.weight_version

    @property
    def training_open(self) -> bool:
        return any(batch.training_started for batch in self.batches)

    def cells_in(self, role: Role) -> list[Cell]:
        return [cell for cell in self.cells if cell.role is role]

    def cells_heading_to(self, role: Role) -> list[Cell]:
        return [cell for cell in self.cells if cell.heading is role]


@dataclasses.dataclass(frozen=True)
class MoveToTraining:
    """Drain the cell's engine, move its sessions elsewhere, and let it join the learner."""

    cell_id: int


@dataclasses.dataclass(frozen=True)
class MoveToRollout:
    """Let the cell leave the learner, load the newest weights and serve again."""

    cell_id: int


@dataclasses.dataclass(frozen=True)
class DispatchBatch:
    """Open the sessions of `step` (tasks x group size) with the newest published weights."""

    step: int


@dataclasses.dataclass(frozen=True)
class StartTraining:
    """Open training step `step`: the learner trains its groups as they finish, on every cell
    in training (membership may grow while the step runs), then publishes weights `step + 1`."""

    step: int


Decision = MoveToTraining | MoveToRollout | DispatchBatch | StartTraining
