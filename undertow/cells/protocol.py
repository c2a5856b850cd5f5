"""The pool of cells as the run's loop sees it (`Pool`), and as `undertow train` gets it
started (`RunParts`): docs/design.md, "From `undertow train` to the loss", steps 2 and 6."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:   # the learner's modules import torch: for the annotations only
    from undertow.cells.elastic.local import CellRoles
    from undertow.cells.policy import Policy
    from undertow.learner.gateway_link import GatewayLink


class Pool(Protocol):
    """What the run's loop needs of a pool: its cells' roles (which carry out the role
    decisions), the policy that decides, the rollout side's session counts, and where new
    weights go. `OneCell` (`one_cell.py`, a run without a `pool` section) and `CellPool`
    (`pool.py`) are the two."""

    @property
    def roles(self) -> CellRoles: ...

    @property
    def policy(self) -> Policy: ...

    def num_sessions(self) -> dict[int, int]:
        """Live sessions pinned to each rollout cell's engine."""
        ...

    def num_closed(self, group_ids: list[str]) -> dict[str, int]:
        """Closed sessions of each group (a group named `g` or `g.<task>`)."""
        ...

    def prepare(self, cell_ids: list[int]) -> None:
        """Starts the engines of cells about to serve, all at once, ahead of `serve`."""
        ...

    def push(self, model_dir: Path, weight_version: int) -> None:
        """Serves the weights in `model_dir` as `weight_version` on every rollout cell."""
        ...


@dataclass(frozen=True)
class RunParts:
    """A started pool as `undertow train` runs it: the gateway's URL as rollouts reach it
    and its admin link, the pool for the loop, and a few words for the start line."""

    url: str
    admin: GatewayLink
    pool: Pool
    description: str
