"""Cells and their roles, with the one table of legal role changes.

A cell is a group of accelerators (or, on CPUs, of threads/processes) that is either serving one
engine (rollout), training in the learner, or switching between the two. A switch is never
instantaneous: the engine must drain and release its memory before the cell joins the learner
(QwenGyre measured 8.52 s), and the cell must load the new weights before it serves again (3.46 s).
So the only way from rollout to training, and back, is through `SWITCHING`, and a switching cell
remembers where it is heading.
"""

import dataclasses
import enum

from undertow.cells.errors import IllegalTransition


class Role(enum.Enum):
    ROLLOUT = "rollout"
    TRAINING = "training"
    SWITCHING = "switching"


# (from, to) -> what happens to the cell on that edge; nothing else is legal.
TRANSITIONS: dict[tuple[Role, Role], str] = {
    (Role.ROLLOUT, Role.SWITCHING): "engine drains, its sessions move, its memory is released",
    (Role.SWITCHING, Role.TRAINING): "the cell joins the learner with the current weights",
    (Role.TRAINING, Role.SWITCHING): "the cell leaves the learner and loads the new weights",
    (Role.SWITCHING, Role.ROLLOUT): "the engine serves again",
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell as the policy sees it.

    Invariants: `heading` is set exactly when `role` is SWITCHING, and is ROLLOUT or TRAINING;
    `0 <= num_sessions`; `num_sessions` is 0 unless the cell is in rollout (a switching cell has
    already handed its sessions on); `num_session_slots` is the number of sessions its engine can
    hold at once (its KV capacity), the C_e of QwenGyre's waterlevel rule.
    """

    cell_id: int
    role: Role = Role.ROLLOUT
    num_session_slots: int = 1
    num_sessions: int = 0
    heading: Role | None = None

    def __post_init__(self):
        if (self.role is Role.SWITCHING) != (self.heading is not None):
            raise ValueError(f"cell {self.cell_id}: heading={self.heading} with role={self.role}; "
                             "a cell has a heading exactly while it is switching")
        if self.heading is Role.SWITCHING:
            raise ValueError(f"cell {self.cell_id}: a switching cell heads to rollout or training")
        if self.num_session_slots < 1 or self.num_sessions < 0:
            raise ValueError(f"cell {self.cell_id}: num_session_slots={self.num_session_slots}, "
                             f"num_sessions={self.num_sessions}; need slots >= 1, sessions >= 0")


def change_role(cell: Cell, to: Role, heading: Role | None = None) -> Cell:
    """The cell after one edge of `TRANSITIONS`; raises IllegalTransition for any other change.

    Entering SWITCHING needs `heading`, the role on the other side; leaving it must go there.
    """
    if (cell.role, to) not in TRANSITIONS:
        raise IllegalTransition(
            f"cell {cell.cell_id} cannot go from {cell.role.value} to {to.value}; the legal "
            f"changes are {sorted(f'{a.value}->{b.value}' for a, b in TRANSITIONS)}")
    if to is Role.SWITCHING:
        expected = Role.TRAINING if cell.role is Role.ROLLOUT else Role.ROLLOUT
        if heading is not expected:
            raise IllegalTransition(f"cell {cell.cell_id} leaving {cell.role.value} must head to "
                                    f"{expected.value}, not {heading}")
        return dataclasses.replace(cell, role=to, heading=heading, num_sessions=0)
    if cell.heading is not to:
        raise IllegalTransition(f"cell {cell.cell_id} is switching to {_heading(cell).value}, "
                                f"it cannot arrive in {to.value}")
    return dataclasses.replace(cell, role=to, heading=None)


def begin_switch(cell: Cell) -> Cell:
    """Rollout -> switching towards training, or training -> switching towards rollout."""
    if cell.role is Role.SWITCHING:
        raise IllegalTransition(f"cell {cell.cell_id} is already switching to "
                                f"{_heading(cell).value}; wait until it arrives")
    heading = Role.TRAINING if cell.role is Role.ROLLOUT else Role.ROLLOUT
    return change_role(cell, Role.SWITCHING, heading)


def finish_switch(cell: Cell) -> Cell:
    """A switching cell arrives in the role it was heading to."""
    return change_role(cell, _heading(cell))


def _heading(cell: Cell) -> Role:
    """Where a switching cell is heading (set exactly while it switches)."""
    if cell.heading is None:
        raise IllegalTransition(f"cell {cell.cell_id} is in {cell.role.value}, not switching")
    return cell.heading
