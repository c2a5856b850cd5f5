"""`ElasticLearner`: the learner whose step is trained by the cells' members.

The run loop (`undertow/cells/loop.py`) drives every learner through the same three calls:
`open_step` when the pool starts a step, `add_group` as each of its groups finishes,
`train_step` once all are in. The plain `Learner` (`learner/train.py`) computes the
gradient in its own process at `train_step`; this one streams each group to the elastic
step (`step.py`) as it comes, so the members on the training cells compute it while the
step's slow sessions still run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from undertow.cells.elastic.step import Coordinator
from undertow.gateway.trees.tree import Tree
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.errors import EmptyStepError
from undertow.learner.train import Learner


class ElasticLearner(Learner):
    """A `Learner` whose backward pass is one streaming elastic step (`step.py`).

    `open_step` opens the step on the coordinator, `add_group` appends one complete
    group's micro-batches to it (its advantages are known once every session is
    closed), and `train_step` finishes it: the members on the training cells computed
    the gradient (however many joined, whenever the groups came), the coordinator
    summed and normalised it into this process's `.grad`; clipping, the optimizer and
    the weights stay here. The members' stats include the behaviour-KL and entropy sums
    (`objective.metric_sums`), so the step's metrics are the plain learner's.

    The learner serves its `coordinator` (the members reach it at `coordinator.address`,
    waiting up to `timeout_s`); `close` ends it.
    """

    def __init__(self, config: TrainConfig, loss: LossConfig, advantages: AdvantageConfig,
                 base_model_dir: Path, run_dir: Path, resolved_config: dict[str, Any] | None = None,
                 model_dir: Path | None = None, *, timeout_s: float = 300.0):
        super().__init__(config, loss, advantages, base_model_dir, run_dir, resolved_config,
                         model_dir)
        self.coordinator = Coordinator(self.policy, timeout_s=timeout_s)

    def close(self) -> None:
        """Stops serving the coordinator's store."""
        self.coordinator.close()

    def open_step(self) -> None:
        """Opens the step that will produce weights `state.step + 1`."""
        self.coordinator.open_step(self.state.step, self.loss)

    def add_group(self, tree: Tree) -> int:
        """Packs one complete group and appends it to the open step; returns the number
        of its micro-batches (0 for a group with no trainable token: it adds no term, as
        in the whole step's packing)."""
        try:
            chunk = self.pack([tree], self.advantages([tree]), self.placement.max_tokens)
        except EmptyStepError:
            return 0
        self.coordinator.append(chunk)
        return len(chunk.micro_batches)

    def abort_step(self) -> None:
        """Aborts the open step, if any: its members drop their partial gradient."""
        if self.coordinator.step_open:
            self.coordinator.abort_step()

    def train_step(self, trees: list[Tree]) -> dict[str, Any]:
        """Finishes the open step, to which every one of `trees` has been added."""
        self.optimizer.zero_grad(set_to_none=True)
        result = self.coordinator.finish_step()
        values = self.apply_gradient(trees, result.stats)
        values.update(num_members=len(result.ranks) - 1)
        self.last_step = {"num_members": values["num_members"],
                          "num_micro_batches": result.num_micro_batches,
                          "drain_s": round(result.drain_s, 3),
                          "reduce_s": round(result.reduce_s, 3)}
        return values
