"""The pool of a run without a `pool` section: one rollout cell that never moves, the
learner training in its own process (docs/design.md, "From `undertow train` to the loss",
step 2). `serve_one_cell` starts its gateway and engine for `undertow train`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.cells.cell import Cell
from undertow.cells.elastic.local import CellRoles
from undertow.cells.errors import CellPoolError
from undertow.cells.policy import Split
from undertow.cells.protocol import RunParts

if TYPE_CHECKING:   # the learner's modules import torch: for the annotations only
    from undertow.learner.train import Learner, WeightSink
    from undertow.run.sections import RunSections


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


class OneCell:
    """A `Pool` of one rollout cell that never moves, whose policy (`Split` with no training
    cell) dispatches steps within `max_staleness` and starts each as soon as it can, and
    reads no session counts; weights go to `sink` (the gateway, in `undertow train`)."""

    def __init__(self, sink: WeightSink, weight_version: int, max_staleness: int):
        self.sink = sink
        self.roles = CellRoles([Cell(0)], _FixedEngine(), _NoMembers(), weight_version)
        self.policy = Split(num_training_cells=0, max_staleness=max_staleness)

    def num_sessions(self) -> dict[int, int]:
        return {}

    def num_closed(self, group_ids: list[str]) -> dict[str, int]:
        return {}

    def prepare(self, cell_ids: list[int]) -> None:
        return None

    def push(self, model_dir: Path, weight_version: int) -> None:
        self.sink.push(model_dir, weight_version)


@contextlib.contextmanager
def serve_one_cell(loop: asyncio.AbstractEventLoop, sections: RunSections, learner: Learner,
                   model_dir: Path, weights: tuple[Path, int]) -> Iterator[RunParts]:
    """The embedded gateway on `loop` with one built-in engine (or `run.engine_urls`)
    serving `weights`, and the `OneCell` pool pushing through it."""
    from undertow.learner.gateway_link import GatewayLink
    from undertow.run.embedded import embedded_gateway, held_on

    run, config = sections.run, sections.learner
    with held_on(loop, embedded_gateway(model_dir, run.run_dir / "store",
                                        run.engine_urls)) as gateway:
        admin = GatewayLink(gateway.url, gateway.admin_token, push_mode=config.push_mode,
                            launched_urls=gateway.launched_urls)
        if weights[1] > 0:
            admin.push(*weights)
        pool = OneCell(admin, learner.state.step, config.max_staleness)
        yield RunParts(gateway.url, admin, pool, f"engines {list(gateway.engine_urls)}")
