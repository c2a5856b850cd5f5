"""The learner: the policy, its optimizer, the run's state and the step function (sync),
which the run's one loop, `RunLoop` (`undertow/cells/loop.py`), drives through `open_step`,
`add_group` and `train_step`; a step's path from trees to AdamW: docs/design.md, "From
`undertow train` to the loss", steps 8-10. Also here, the loop's edges as small protocols
(`GroupSource`, `WeightSink`), so that the loop is the same for the embedded run of
`undertow train`, a remote gateway and tests.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from undertow.gateway.trees.tree import Tree
from undertow.learner.advantages import (
    group_advantages,
    is_timed_out,
    is_uniform,
    session_rewards,
    valid_sessions,
)
from undertow.learner.checkpoint import (
    PendingGroup,
    TrainState,
    clear_dead_start,
    load_checkpoint,
    record_start,
    restorable_checkpoint,
    save_checkpoint,
    save_weights,
)
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig, torch_dtype
from undertow.learner.errors import EmptyStepError, MicroBatchTooLongError
from undertow.learner.metrics_log import MetricsLog
from undertow.learner.mismatch import mismatch_metrics
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import PackedStep, pack_step
from undertow.learner.sharding import place

PASS_REWARD = 1.0


@dataclass(frozen=True)
class GroupRequest:
    """Run `group_size` sessions of task number `index` (the source maps it to a task
    and derives any seeds from it) in gateway group `group_id`."""

    index: int
    group_id: str
    group_size: int
    weight_version: int


@dataclass
class FinishedGroup:
    """A group whose sessions are all closed with rewards.

    `failures`: its sessions that Undertow failed, by cause (also those that never
    opened, so not in the tree); `num_reruns`: sessions run again after such a failure;
    `error`: one failure's message. A source that leaves them empty has them read
    from the tree's close metas."""

    index: int
    tree: Tree
    rollout_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    num_reruns: int | None = None
    error: str = ""


class GroupSource(Protocol):
    """`launch(request)` starts a group (the rollouts of one task) and returns at once;
    `wait(timeout_s)` returns the groups finished since."""

    def launch(self, request: GroupRequest) -> None: ...

    def wait(self, timeout_s: float) -> list[FinishedGroup]: ...


class WeightSink(Protocol):
    """`push(model_dir, weight_version)` returns once the engines serve the weights."""

    def push(self, model_dir: Path, weight_version: int) -> None: ...


def group_id_of(index: int, num_resumes: int) -> str:
    return f"g{index:06d}-r{num_resumes}"


class Learner:
    """The policy, its optimizer and the run's state. `train_step` trains on one step's
    trees and `save` writes the weights; the run's one loop, `RunLoop`
    (`undertow/cells/loop.py`), drives it."""

    def __init__(self, config: TrainConfig, loss: LossConfig, advantages: AdvantageConfig,
                 base_model_dir: Path, run_dir: Path, resolved_config: dict[str, Any] | None = None,
                 model_dir: Path | None = None):
        self.config, self.loss, self.advantage_config = config, loss, advantages
        self.base_model_dir, self.run_dir = Path(base_model_dir), Path(run_dir)
        self.resolved_config = resolved_config or {}
        torch.manual_seed(config.seed)
        options = {"dtype": torch_dtype(config.dtype),
                   "head_chunk_tokens": config.head_chunk_tokens}
        self.policy = PolicyModel.load(model_dir or base_model_dir, **options)
        self.policy.model.train()
        self.policy.freeze(config.frozen)
        self.reference = PolicyModel.load(base_model_dir, **options) if loss.kl_coef else None
        self.placement = place(config, self.policy, self.reference)   # before the optimizer
        for policy in (self.policy, self.reference):
            if policy is not None:
                policy.max_segment_tokens = config.segment_tokens(self.placement.max_tokens)
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(), lr=config.lr, betas=(config.beta1, config.beta2),
            eps=config.adam_eps, weight_decay=config.weight_decay)
        self.state = TrainState()
        self.restored_from: Path | None = None   # the checkpoint `restore` read
        self.pending: list[PendingGroup] = []
        self.last_step: dict[str, Any] = {}   # the last step's figures for the timeline
        self.metrics = MetricsLog(self.run_dir)

    @classmethod
    def restore(cls, config: TrainConfig, loss: LossConfig, advantages: AdvantageConfig,
                base_model_dir: Path, run_dir: Path,
                resolved_config: dict[str, Any] | None = None, **options: Any) -> Learner:
        """The learner of the latest whole checkpoint of `run_dir` (a fresh one if none):
        weights, optimizer, state and the finished groups not yet trained; a damaged
        checkpoint is set aside and said so (`checkpoint.restorable_checkpoint`)."""
        path = restorable_checkpoint(run_dir)
        if path is None:
            return cls(config, loss, advantages, base_model_dir, run_dir, resolved_config,
                       **options)
        learner = cls(config, loss, advantages, base_model_dir, run_dir, resolved_config,
                      model_dir=path / "model", **options)
        checkpoint = load_checkpoint(path, learner.optimizer)
        learner.state, learner.pending = checkpoint.state, checkpoint.pending
        learner.restored_from = path
        learner.state.num_resumes += 1
        learner.metrics.truncate_after(learner.state.step)
        return learner

    def begin_run(self) -> None:
        """Called once by a run (new or resumed) before it launches any group: records
        this start (`checkpoint.record_start`: `state.num_resumes`, in every group ID, is
        never one an earlier start used, even one that died before its first checkpoint),
        cuts `metrics.jsonl` back to `state.step` and removes the weights and temporaries
        that a dead start left past it."""
        self.state.num_resumes = record_start(self.run_dir, self.state.num_resumes)
        self.metrics.truncate_after(self.state.step)
        clear_dead_start(self.run_dir, self.state.step)

    @property
    def weight_version(self) -> int:
        return self.state.step

    def open_step(self) -> None:
        """The loop opens the step that will produce weights `state.step + 1`; nothing
        to do here (the step is computed at `train_step`)."""

    def add_group(self, tree: Tree) -> int:
        """One finished group of the open step: the number of micro-batches it packs
        into alone (0: no trainable token; the loop drops and replaces it)."""
        try:
            return len(self.pack([tree], self.advantages([tree]),
                                 self.placement.max_tokens).micro_batches)
        except EmptyStepError:
            return 0

    def abort_step(self) -> None:
        """The loop stops or fails with a step open; nothing was started here."""

    def advantages(self, trees: list[Tree]) -> dict[tuple[str, str], float]:
        """Each valid session's advantage within its group, by (group ID, session ID)."""
        return {(tree.group_id, session_id): value for tree in trees for session_id, value
                in group_advantages(tree, self.advantage_config).items()}

    def train_step(self, trees: list[Tree]) -> dict[str, Any]:
        """One optimizer step on the groups' trees; returns the step's metrics."""
        step = self.placement.prepare(self.pack(trees, self.advantages(trees),
                                                self.placement.max_tokens))
        self.optimizer.zero_grad(set_to_none=True)
        with self.placement.compute():
            stats = backward_step(self.policy, step, self.loss, self.reference)
        self.last_step = {"num_micro_batches": len(step.micro_batches)}
        return self.apply_gradient(trees, stats)

    def pack(self, trees: list[Tree], advantages: dict[tuple[str, str], float],
             max_tokens: int) -> PackedStep:
        """The trees packed in micro-batches of at most `max_tokens`, long paths as
        `learner.long_paths` says; MicroBatchTooLongError where "split" cannot keep that."""
        step = pack_step(trees, advantages, max_tokens, self.loss.paths_per_session,
                         long_paths=self.config.long_paths, weight_version=self.state.step)
        longest = max(mb.num_tokens for mb in step.micro_batches)
        if self.config.long_paths == "split" and longest > max_tokens:
            raise MicroBatchTooLongError(
                f"a path with its context needs a micro-batch of {longest} tokens, over the "
                f"micro-batch bound of {max_tokens} (learner.max_tokens or "
                "learner.micro_batch_tokens); set learner.long_paths: whole to train it "
                "whole, scored in segments of learner.max_segment_tokens, or raise the bound")
        return step

    def apply_gradient(self, trees: list[Tree], stats: dict[str, float]) -> dict[str, float]:
        """Clips the gradient in `.grad`, steps the optimizer and returns the metrics of
        the step on `trees`, from the step's `stats` summed over its micro-batches as
        `objective.backward_step` sums them (the elastic run's coordinator, over members,
        the same way): the one backward path of both runs."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(),
                                                   self.config.max_grad_norm)
        self.optimizer.step()
        self.state.step += 1
        rewards = [r for t in trees for r in valid_sessions(t).values()]
        totals = {name: stats.get(name, 0.0) for name in (
            "loss", "num_terms", "num_clipped", "behaviour_kl_sum", "entropy_sum", "kl_sum")}
        num_terms = max(totals["num_terms"], 1.0)
        num_unique = sum(t.num_unique_tokens for t in trees)
        num_flat = sum(t.num_flat_tokens for t in trees)
        values = {
            "loss": totals["loss"], "kl": totals["behaviour_kl_sum"] / num_terms,
            "entropy": totals["entropy_sum"] / num_terms,
            "clip_fraction": totals["num_clipped"] / num_terms, "grad_norm": float(grad_norm),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "pass_rate": (sum(r >= PASS_REWARD for r in rewards) / len(rewards)
                          if rewards else None),
            "num_groups": len(trees), "num_sessions": len(rewards),
            "num_uniform_groups": sum(is_uniform(session_rewards(t, self.advantage_config))
                                      for t in trees),
            "num_cut_sessions": sum(is_timed_out(t, s) for t in trees for s in valid_sessions(t)),
            "num_trained_tokens": int(totals["num_terms"]), "num_unique_tokens": num_unique,
            "num_flat_tokens": num_flat,
            "unique_flat_ratio": num_unique / num_flat if num_flat else None}
        if self.reference is not None:
            values["kl_ref"] = totals["kl_sum"] / num_terms   # the loss's KL to the reference
        values.update(mismatch_metrics(stats))   # train/sample mismatch, masked fractions
        return values

    def save(self, checkpoint: bool, pending: list[PendingGroup] | None = None) -> Path:
        """Writes the current weights (in a checkpoint, with `pending`: the finished groups
        not yet trained, by default those it was restored with); returns the model
        directory to push."""
        if checkpoint:
            path = save_checkpoint(self.run_dir, self.state, self.policy.model, self.optimizer,
                                   self.base_model_dir, self.resolved_config,
                                   self.pending if pending is None else pending,
                                   keep=self.config.keep_checkpoints)
            return path / "model"
        return save_weights(self.run_dir, self.state.step, self.policy.model,
                            self.base_model_dir)
