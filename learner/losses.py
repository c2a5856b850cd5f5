"""Policy losses over the terms of a packed step, chosen by name (`config.LossConfig`): the
per-term f_t (`token_terms`), the step's normaliser weights (`step_weights`) and a
micro-batch's share of the loss (`micro_batch_loss`). The objective, its corrections,
masks and aggregations: docs/training.md, "The objective".
"""

from __future__ import annotations

import torch

from undertow.learner.config import LossConfig
from undertow.learner.errors import LossConfigError
from undertow.learner.packing import MicroBatch, PackedStep


def _count(index: torch.Tensor, size: int) -> torch.Tensor:
    return torch.bincount(index, minlength=size).to(torch.float64)


def _token_mean(session, path, config):
    return torch.full(session.shape, 1.0 / session.numel(), dtype=torch.float64)


def _grpo(session, path, config):
    per_session = _count(session, int(session.max()) + 1)
    num_sessions = int((per_session > 0).sum())
    return 1.0 / (num_sessions * per_session[session])


def _dr_grpo(session, path, config):
    num_sessions = int(torch.unique(session).numel())
    return torch.full(session.shape, 1.0 / (num_sessions * config.dr_grpo_num_tokens),
                      dtype=torch.float64)


def _gyre(session, path, config):
    num_paths = int(path.max()) + 1
    pair = session * num_paths + path
    per_pair = _count(pair, int(pair.max()) + 1)
    pairs_of_session = _count(torch.unique(pair) // num_paths, int(session.max()) + 1)
    num_sessions = int((pairs_of_session > 0).sum())
    return 1.0 / (num_sessions * pairs_of_session[session] * per_pair[pair])


LOSSES = {"token_mean": _token_mean, "grpo": _grpo, "dr_grpo": _dr_grpo, "gyre": _gyre}


def term_weights(config: LossConfig, term_session: torch.Tensor,
                 term_path: torch.Tensor) -> torch.Tensor:
    """(N,) float64 normaliser weight of each term of the whole step."""
    return LOSSES[config.name](term_session, term_path, config)


def step_weights(config: LossConfig, step: PackedStep) -> torch.Tensor:
    return term_weights(config, step.term_session, step.term_path)


def _num_terms(term_session: torch.Tensor) -> int:
    return int(term_session.numel())


def _num_sessions(term_session: torch.Tensor) -> int:
    return int(torch.unique(term_session).numel())


# Per loss: the count over the whole step that its normaliser divides by, as a function
# of a chunk's term sessions. Every loss's weight is a part known from the term's own
# group times 1 / this count, and the count of a step is the sum of the counts of its
# disjoint chunks of whole groups; so a step streamed in chunks can weight each chunk by
# `chunk_weights` and divide the summed gradient by the step's count at the end.
STEP_COUNTS = {"token_mean": _num_terms, "grpo": _num_sessions, "dr_grpo": _num_sessions,
               "gyre": _num_sessions}


def step_count(config: LossConfig, chunk: PackedStep) -> int:
    """This chunk's share of the count that the step's normaliser divides by."""
    if config.name not in STEP_COUNTS:
        raise LossConfigError(f"loss {config.name!r} has no streaming normaliser; add its "
                              "step-wide count to losses.STEP_COUNTS")
    return STEP_COUNTS[config.name](chunk.term_session)


def chunk_weights(config: LossConfig, chunk: PackedStep) -> torch.Tensor:
    """(N,) float64 unnormalised weight of each term of `chunk` (whole groups): its
    weight in a step made of this chunk alone, times the chunk's `step_count`. Divided
    by the step's total count it is the term's weight in the whole step."""
    return step_weights(config, chunk) * step_count(config, chunk)


def _no_correction(logprobs, behaviour, config):
    return torch.exp(logprobs - behaviour), torch.ones_like(logprobs)


def _decoupled_ppo(logprobs, behaviour, config):
    proximal = logprobs.detach()
    weight = torch.exp(proximal - behaviour)
    weight = torch.where(weight > config.max_importance_weight, 0.0, weight)
    return torch.exp(logprobs - proximal), weight


def _tis(logprobs, behaviour, config):
    proximal = logprobs.detach()
    weight = torch.exp(proximal - behaviour).clamp(max=config.max_importance_weight)
    return torch.exp(logprobs - proximal), weight


def _mis(logprobs, behaviour, config):
    proximal = logprobs.detach()
    weight = torch.exp(proximal - behaviour)
    inside = (weight >= config.mis_low) & (weight <= config.mis_high)
    return torch.exp(logprobs - proximal), torch.where(inside, weight, 0.0)


CORRECTIONS = {"none": _no_correction, "decoupled_ppo": _decoupled_ppo, "tis": _tis,
               "mis": _mis}


def sequence_keep(config: LossConfig, logprobs: torch.Tensor, behaviour: torch.Tensor,
                  term_session: torch.Tensor) -> torch.Tensor:
    """(N,) bool over the step's terms: False where `sequence_mask` masks the term's
    session (docs/training.md; True everywhere when it is "none"). `logprobs` are the
    policy's over ALL of the step's terms (no gradient needed)."""
    if config.sequence_mask == "none":
        return torch.ones(term_session.shape, dtype=torch.bool)
    log_ratio = logprobs.detach().to(torch.float64) - behaviour.to(torch.float64)
    num_sessions = int(term_session.max()) + 1
    sums = torch.zeros(num_sessions, dtype=torch.float64).index_add_(0, term_session, log_ratio)
    geometric = torch.exp(sums / _count(term_session, num_sessions).clamp(min=1))
    kept = (geometric >= config.sequence_mask_low) & (geometric <= config.sequence_mask_high)
    return kept[term_session]


def token_terms(config: LossConfig, logprobs: torch.Tensor, behaviour: torch.Tensor,
                advantages: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                version_gap: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """(N,) per-term f_t (docs/training.md) and unweighted sums for metrics. `keep`:
    (N,) bool, the terms' `sequence_keep` (needed when `sequence_mask` is on);
    `version_gap`: (N,) long, the terms' version gaps (needed when
    `max_token_version_gap` is set)."""
    behaviour = behaviour.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype)
    ratio, weight = CORRECTIONS[config.correction](logprobs, behaviour, config)
    masked = {}
    if config.max_token_version_gap is not None:
        if version_gap is None:
            raise LossConfigError("max_token_version_gap needs the terms' version gaps "
                                  "(PackedStep.term_version_gap)")
        stale = version_gap.to(weight.device) > config.max_token_version_gap
        weight = torch.where(stale, 0.0, weight)
        masked["num_version_masked"] = float(stale.sum())
    if config.sequence_mask != "none":
        if keep is None:
            raise LossConfigError("sequence_mask needs the terms' keep mask "
                                  "(losses.sequence_keep over the whole step)")
        keep = keep.to(weight.device)
        weight = torch.where(keep, weight, 0.0)
        masked["num_sequence_masked"] = float((~keep).sum())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages
    terms = -weight * torch.minimum(unclipped, clipped)
    stats = {"num_terms": float(logprobs.numel()),
             "num_clipped": float((clipped < unclipped).sum()),
             "importance_weight_sum": float(weight.sum()),
             "num_dropped": float((weight == 0).sum()), **masked}
    if config.kl_coef:
        if ref_logprobs is None:
            raise LossConfigError("kl_coef > 0 needs the reference model's logprobs")
        log_ratio = ref_logprobs.to(logprobs.dtype) - logprobs
        k3 = torch.exp(log_ratio) - log_ratio - 1
        terms = terms + config.kl_coef * k3
        stats["kl_sum"] = float(k3.detach().sum())
    if config.entropy_coef:
        if entropy is None:
            raise LossConfigError("entropy_coef > 0 needs the policy's entropy")
        terms = terms - config.entropy_coef * entropy
        stats["entropy_sum"] = float(entropy.detach().sum())
    return terms, stats


def micro_batch_loss(config: LossConfig, step: PackedStep, micro_batch: MicroBatch,
                     weights: torch.Tensor, logprobs: torch.Tensor,
                     entropy: torch.Tensor | None = None,
                     ref_logprobs: torch.Tensor | None = None,
                     keep: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the step's loss (the shares sum to the step loss).

    `logprobs`/`entropy`/`ref_logprobs` are (N,) over `micro_batch.term_ids`;
    `weights` is `step_weights(config, step)`; `keep` is `sequence_keep` over the
    whole step's terms (when `sequence_mask` is on).
    """
    ids = micro_batch.term_ids
    terms, stats = token_terms(config, logprobs, step.behaviour_logprobs[ids],
                               step.advantages[ids], ref_logprobs, entropy,
                               None if keep is None else keep[ids.to(keep.device)],
                               step.term_version_gap[ids.to(step.term_version_gap.device)])
    weighted = weights[ids].to(terms.dtype) * terms
    loss = weighted.sum()
    stats["loss"] = float(loss.detach())
    # The scale of the sum: the loss itself may cancel to near zero across sessions.
    stats["loss_abs_sum"] = float(weighted.detach().abs().sum())
    return loss, stats
