"""The step's objective on the packed trees: forward, loss and backward per micro-batch
(`backward_step`, `backward_micro_batch`: the one backward path of the plain learner, the
elastic members and FSDP2 cells; docs/design.md, "From `undertow train` to the loss", step
9). Each micro-batch's stats combine over micro-batches and members by `merge_stats`.
"""

from __future__ import annotations

import torch

from undertow.learner.config import LossConfig
from undertow.learner.errors import LossConfigError
from undertow.learner.losses import micro_batch_loss, sequence_keep, step_weights
from undertow.learner.mismatch import mismatch_sums, version_gap_sums
from undertow.learner.model import PolicyModel
from undertow.learner.packing import PackedStep


def backward_step(policy: PolicyModel, step: PackedStep, config: LossConfig,
                  reference: PolicyModel | None = None, backward: bool = True
                  ) -> dict[str, float]:
    """Accumulates the step's gradient into the parameters' `.grad` (unless
    `backward` is False); returns the summed stats ("loss", "num_terms",
    "num_clipped", ... see `losses.token_terms`). The normaliser weights are computed
    over the whole step once; each micro-batch's share of the loss is backpropagated at
    once, so one micro-batch's activations are alive at a time, and the shares and
    gradients sum to the step's."""
    weights = step_weights(config, step)
    totals: dict[str, float] = {}
    for index in range(len(step.micro_batches)):
        merge_stats(totals, backward_micro_batch(policy, step, weights, index, config,
                                                 reference, backward))
    return totals


def merge_stats(totals: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """Adds one micro-batch's (or member's) `stats` into `totals`, in place: a key
    ending in "_max" keeps the maximum, every other key is a sum."""
    for name, value in stats.items():
        if name.endswith("_max"):
            totals[name] = max(totals.get(name, value), value)
        else:
            totals[name] = totals.get(name, 0.0) + value
    return totals


def sequence_keep_of(policy: PolicyModel, step: PackedStep, config: LossConfig
                     ) -> torch.Tensor | None:
    """The step's (N,) `losses.sequence_keep`, None without a sequence mask. Computed
    on first use from one forward pass without gradient over every micro-batch of the
    step and kept on it (`PackedStep.sequence_keep`), so each step pays it once. In a
    sharded mesh every process must call this at the same point (its forwards are
    collectives)."""
    if config.sequence_mask == "none":
        return None
    if step.sequence_keep is None:
        logprobs = torch.zeros(step.num_terms, dtype=torch.float64)
        with torch.no_grad():
            for micro_batch in step.micro_batches:
                scores = policy.score(micro_batch).logprobs
                logprobs[micro_batch.term_ids.cpu()] = scores.to("cpu", torch.float64)
        step.sequence_keep = sequence_keep(config, logprobs, step.behaviour_logprobs.cpu(),
                                           step.term_session.cpu())
    return step.sequence_keep


def backward_micro_batch(policy: PolicyModel, step: PackedStep, weights: torch.Tensor,
                         index: int, config: LossConfig, reference: PolicyModel | None = None,
                         backward: bool = True) -> dict[str, float]:
    """Scores micro-batch `index` of `step`, backpropagates its share of the loss with
    the terms weighted by `weights` (`losses.step_weights`, or `losses.chunk_weights`
    for a streamed step) and returns its stats, with `metric_sums` whatever the loss."""
    micro_batch = step.micro_batches[index]
    keep = sequence_keep_of(policy, step, config)
    scores = policy.score(micro_batch, with_entropy=True)
    ref_logprobs = None
    if config.kl_coef:
        if reference is None:
            raise LossConfigError("LossConfig.kl_coef > 0 needs a reference model")
        with torch.no_grad():
            ref_logprobs = reference.score(micro_batch).logprobs
    loss, stats = micro_batch_loss(config, step, micro_batch, weights, scores.logprobs,
                                   scores.entropy, ref_logprobs, keep)
    if backward:
        loss.backward()
    behaviour = step.behaviour_logprobs[micro_batch.term_ids]
    assert scores.entropy is not None, "scored with_entropy"
    stats.update(metric_sums(scores.logprobs, scores.entropy, behaviour))
    stats.update(mismatch_sums(scores.logprobs, behaviour))
    gaps = step.term_version_gap
    stats.update(version_gap_sums(gaps[micro_batch.term_ids.to(gaps.device)]))
    return stats


def metric_sums(logprobs: torch.Tensor, entropy: torch.Tensor,
                behaviour: torch.Tensor) -> dict[str, float]:
    """The sums behind a step's `kl` and `entropy` metrics over (N,) terms, whatever
    the loss: the k3 estimate of KL(behaviour || policy) (how far the weights trained
    have moved from those that sampled) and the policy's entropy."""
    with torch.no_grad():
        log_ratio = behaviour.to(logprobs) - logprobs
        return {"behaviour_kl_sum": float((torch.exp(log_ratio) - log_ratio - 1).sum()),
                "entropy_sum": float(entropy.sum())}
