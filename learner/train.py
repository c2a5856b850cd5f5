"""The training loop: finished groups in, new weight versions out (sync; docs/design.md,
data flow step 6).

One step: take `groups_per_step` finished groups -> advantages per group
(`advantages.py`) -> pack the trees (`packing.py`) -> per micro-batch forward, loss
share and backward (`objective.backward_step`: `model.py`, `losses.py`; the elastic run's
members call the same per micro-batch) -> clip the gradient norm -> AdamW step
-> write the weights as a model directory (a checkpoint every `checkpoint_every`
steps, `checkpoint.py`) -> push them to the engines as the next weight version ->
one metrics line (`metrics_log.py`).

Where groups come from and where weights go are two small protocols, so the loop is
the same for the embedded run of `undertow train`, a remote gateway, and tests:
- `GroupSource.launch(request)` starts a group (the rollouts of one task) and
  returns at once; `GroupSource.wait(timeout_s)` returns the groups finished since;
- `WeightSink.push(model_dir, weight_version)` returns once the engines serve it.

Asynchrony with bounded staleness: groups keep running while a step trains, but a
group is launched only if it will be trained by weights at most `max_staleness`
versions newer than those it samples with (launches happen after each push, and
while at most `(max_staleness + 1) * groups_per_step` groups are launched and not
yet trained). A group whose oldest sampled token is still older than that when it is
taken is dropped and replaced (`drop_stale`), e.g. a long session that straddled
several updates.

Only real outcomes train: a finished group's sessions that Undertow failed (their
close meta says so, `advantages.valid_sessions`) have no advantage and no loss; the
rollout source has already re-run them as new sessions of the group. The rules
(shared with the pool's loop) are `admission.py`'s: a group left
with fewer than two valid sessions (one when `group_size` is 1) is dropped, with its
reason printed, and replaced; with `advantages.filter_uniform_groups`, so is a group
whose valid sessions all got the same reward (at most `advantages.max_extra_groups`
per step). A step whose groups hold no trainable token (`EmptyStepError`) is not
trained: its groups are dropped and more are launched. When `max_failed_groups`
groups in a row are dropped because Undertow failed their sessions, the run stops
with one `RunFailedError` naming the causes and the last error. Each step counts
what it dropped and re-ran (`num_dropped_uniform`, `num_dropped_invalid`,
`infra_failures` by cause, `num_rerun_sessions`) in its metrics line.

Stopping and resuming: `stop` (set by SIGTERM in the command line) is checked while
waiting for groups and between steps; the loop then writes a checkpoint holding the
finished groups not yet trained and returns. `Learner.restore` continues from the
latest checkpoint: pending groups are trained first, groups that were in flight are
launched again (same launch index, so a deterministic source repeats them; new
group ID, so the gateway's store keeps both).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from undertow.gateway.tree import Tree
from undertow.learner.admission import Admission, StepCounts, note_drop
from undertow.learner.advantages import AdvantageConfig, group_advantages, valid_sessions
from undertow.learner.checkpoint import (
    PendingGroup,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_weights,
)
from undertow.learner.config import TrainConfig, torch_dtype
from undertow.learner.errors import EmptyStepError, MicroBatchTooLongError
from undertow.learner.losses import LossConfig
from undertow.learner.metrics_log import MetricsLog
from undertow.learner.mismatch import mismatch_metrics
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import PackedStep, pack_step
from undertow.learner.sharding import place
from undertow.learner.trees import group_staleness

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
    def launch(self, request: GroupRequest) -> None: ...

    def wait(self, timeout_s: float) -> list[FinishedGroup]: ...


class WeightSink(Protocol):
    def push(self, model_dir: Path, weight_version: int) -> None: ...


def group_id_of(index: int, num_resumes: int) -> str:
    return f"g{index:06d}-r{num_resumes}"


class Learner:
    """The policy, its optimizer and the run's state; `run` is the loop."""

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
        self.pending: list[PendingGroup] = []
        self.metrics = MetricsLog(self.run_dir)

    @classmethod
    def restore(cls, config: TrainConfig, loss: LossConfig, advantages: AdvantageConfig,
                base_model_dir: Path, run_dir: Path,
                resolved_config: dict[str, Any] | None = None) -> Learner:
        """The learner of the latest checkpoint of `run_dir` (a fresh one if none)."""
        path = latest_checkpoint(run_dir)
        if path is None:
            return cls(config, loss, advantages, base_model_dir, run_dir, resolved_config)
        learner = cls(config, loss, advantages, base_model_dir, run_dir, resolved_config,
                      model_dir=path / "model")
        checkpoint = load_checkpoint(path, learner.optimizer)
        learner.state, learner.pending = checkpoint.state, checkpoint.pending
        learner.state.num_resumes += 1
        learner.metrics.truncate_after(learner.state.step)
        return learner

    @property
    def weight_version(self) -> int:
        return self.state.step

    def train_step(self, trees: list[Tree]) -> dict[str, float]:
        """One optimizer step on the groups' trees; returns the step's metrics."""
        advantages = {}
        for tree in trees:
            for session_id, value in group_advantages(tree, self.advantage_config).items():
                advantages[(tree.group_id, session_id)] = value
        step = self.placement.prepare(self.pack(trees, advantages, self.placement.max_tokens))
        self.optimizer.zero_grad(set_to_none=True)
        with self.placement.compute():
            stats = backward_step(self.policy, step, self.loss, self.reference)
        return self.apply_gradient(trees, stats)

    def pack(self, trees: list[Tree], advantages: dict[tuple[str, str], float],
             max_tokens: int) -> PackedStep:
        """The trees packed in micro-batches of at most `max_tokens`, long paths as
        `learner.long_paths` says; MicroBatchTooLongError where "split" cannot keep that."""
        step = pack_step(trees, advantages, max_tokens, self.loss.paths_per_session,
                         long_paths=self.config.long_paths)
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
            "num_trained_tokens": int(totals["num_terms"]), "num_unique_tokens": num_unique,
            "num_flat_tokens": num_flat,
            "unique_flat_ratio": num_unique / num_flat if num_flat else None}
        if self.reference is not None:
            values["kl_ref"] = totals["kl_sum"] / num_terms   # the loss's KL to the reference
        values.update(mismatch_metrics(stats))   # train/sample mismatch, masked fractions
        return values

    def save(self, checkpoint: bool) -> Path:
        """Writes the current weights (in a checkpoint, with `pending`); returns the
        model directory to push."""
        if checkpoint:
            path = save_checkpoint(self.run_dir, self.state, self.policy.model, self.optimizer,
                                   self.base_model_dir, self.resolved_config, self.pending,
                                   keep=self.config.keep_checkpoints)
            return path / "model"
        return save_weights(self.run_dir, self.state.step, self.policy.model,
                            self.base_model_dir)

    def run(self, source: GroupSource, sink: WeightSink, stop: threading.Event | None = None,
            on_step: Callable[[dict[str, Any]], None] | None = None) -> str:
        """Trains until `num_steps` steps are done ("done") or `stop` is set ("stopped");
        `on_step` receives each step's metrics record (and may print it)."""
        loop = _Loop(self, source, sink, stop or threading.Event())
        loop.on_step = on_step or (lambda record: None)
        return loop.run()


class _Loop:
    """The bookkeeping of `Learner.run`: launches, waits, admission, staleness, timing."""

    def __init__(self, learner: Learner, source: GroupSource, sink: WeightSink,
                 stop: threading.Event):
        self.learner, self.source, self.sink, self.stop = learner, source, sink, stop
        self.config, self.state = learner.config, learner.state
        self.advantage_config = learner.advantage_config
        self.ready: list[PendingGroup] = list(learner.pending)
        self.on_step: Callable[[dict[str, Any]], None] = lambda record: None
        self.counts = StepCounts()
        self.admission = Admission(self.config.group_size, self.config.max_failed_groups,
                                   self.advantage_config)

    def run(self) -> str:
        self._relaunch_in_flight()
        while self.state.step < self.config.num_steps:
            started_s = time.perf_counter()
            groups = self._collect()
            if groups is None:
                self._save_pending()
                return "stopped"
            rollout_s = time.perf_counter() - started_s
            staleness = [group_staleness(g.tree, self.state.step) for g in groups]
            train_started_s = time.perf_counter()
            try:
                values = self.learner.train_step([g.tree for g in groups])
            except EmptyStepError as error:
                self._note_drop("empty", f"{len(groups)} group(s) not trained: {error}")
                continue
            train_s = time.perf_counter() - train_started_s
            values.update(rollout_s=rollout_s, train_s=train_s,
                          staleness_mean=sum(staleness) / len(staleness),
                          staleness_max=max(staleness), **self._step_counts())
            sync_started_s = time.perf_counter()
            self.learner.pending = list(self.ready)
            model_dir = self.learner.save(self._is_checkpoint_step())
            self.sink.push(model_dir, self.state.step)
            values["sync_s"] = time.perf_counter() - sync_started_s
            values["step_s"] = time.perf_counter() - started_s
            self.on_step(self.learner.metrics.append(self.state.step, self.state.step, values))
            if self.stop.is_set() and self.state.step < self.config.num_steps:
                self._save_pending()
                return "stopped"
        return "done"

    def _step_counts(self) -> dict[str, Any]:
        """What the step dropped and re-ran since the last step; the counters restart."""
        counts, self.counts = self.counts.metrics(), StepCounts()
        return counts

    def _note_drop(self, reason: str, message: str) -> None:
        note_drop(self.counts, self.state.step + 1, reason, message)

    def _is_checkpoint_step(self) -> bool:
        step = self.state.step
        return step % self.config.checkpoint_every == 0 or step == self.config.num_steps

    def _save_pending(self) -> None:
        self.learner.pending = list(self.ready)
        self.learner.save(checkpoint=True)

    def _relaunch_in_flight(self) -> None:
        known = set(self.state.consumed) | {g.index for g in self.ready}
        for index in range(self.state.num_launched):
            if index not in known:
                self._launch(index)

    def _launch(self, index: int) -> None:
        self.source.launch(GroupRequest(
            index=index, group_id=group_id_of(index, self.state.num_resumes),
            group_size=self.config.group_size, weight_version=self.state.step))

    def _launch_allowed(self) -> None:
        """Launches new groups while the staleness bound and the run's need allow."""
        gps = self.config.groups_per_step
        live = self.state.num_launched - len(self.state.consumed)
        needed = (self.config.num_steps - self.state.step) * gps
        while live < min((self.config.max_staleness + 1) * gps, needed):
            self._launch(self.state.num_launched)
            self.state.num_launched += 1
            live += 1

    def _collect(self) -> list[PendingGroup] | None:
        """The next step's groups (launching as allowed); None when stopped first."""
        gps = self.config.groups_per_step
        deadline_s = time.monotonic() + self.config.group_timeout_s
        while not self.stop.is_set():
            self._drop_stale()
            if len(self.ready) >= gps:
                groups, self.ready = self.ready[:gps], self.ready[gps:]
                self.state.consumed.extend(g.index for g in groups)
                return groups
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"no group finished within learner.group_timeout_s="
                                   f"{self.config.group_timeout_s}; are the rollouts running?")
            self._launch_allowed()
            for group in self.source.wait(timeout_s=0.5):
                self._admit(group)
        return None

    def _admit(self, group: FinishedGroup) -> None:
        """Adds a finished group to the ready ones, or drops it (`admission.py`: counted,
        reason printed; its index is consumed, so `_launch_allowed` launches a
        replacement)."""
        if self.admission.admit(group, self.counts, self.state.step + 1) is not None:
            self.state.consumed.append(group.index)
            return
        self.ready.append(PendingGroup(group.index, group.tree, group.rollout_s))

    def _drop_stale(self) -> None:
        """Drops (and counts) ready groups over the staleness bound, if configured."""
        if not self.config.drop_stale:
            return
        kept = []
        for group in self.ready:
            staleness = group_staleness(group.tree, self.state.step)
            if staleness > self.config.max_staleness:
                self.state.consumed.append(group.index)
                self._note_drop("stale", f"group {group.tree.group_id}: sampled by weights "
                                f"{staleness} versions old (learner.max_staleness="
                                f"{self.config.max_staleness}; are the weights reaching the "
                                "engines?)")
            else:
                kept.append(group)
        self.ready = kept
