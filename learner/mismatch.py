"""Train/sample mismatch of a step: how far the learner's logprobs of the trained tokens are
from the behaviour logprobs the engine recorded, d_t = l_t - mu_t (the ratio is exp(d_t)).
Each micro-batch's stats (`mismatch_sums`, `version_gap_sums`) are sums or maxima that
`objective.merge_stats` combines over micro-batches and members, so the step's metrics
(`mismatch_metrics`; their names: `metrics_log.py`) do not depend on how it was split.
"""

from __future__ import annotations

import math

import torch

BIN_FLOOR = 1e-6
BINS_PER_DECADE = 20
COUNT_KEY, SUM_KEY = "ratio_bin_count:", "ratio_bin_sum:"
QUANTILES = {"ratio_p5": 0.05, "ratio_p50": 0.5, "ratio_p95": 0.95}
GAP_KEY = "num_version_gap:"
GAP_FRACTIONS = ("version_gap0_fraction", "version_gap1_fraction", "version_gap2_fraction",
                 "version_gap3plus_fraction")   # the last: a gap of 3 or more


def ratio_bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """(N,) long histogram bin of each log ratio d: 0 for |d| < `BIN_FLOOR`, else +-j
    (the sign of d) for BIN_FLOOR * 10^((j-1)/BINS_PER_DECADE) <= |d| <
    BIN_FLOOR * 10^(j/BINS_PER_DECADE)."""
    magnitude = log_ratio.abs().to(torch.float64)
    above = magnitude >= BIN_FLOOR
    decades = torch.log10(torch.where(above, magnitude, 1.0) / BIN_FLOOR)
    index = (torch.floor(decades * BINS_PER_DECADE) + 1).to(torch.long)
    return torch.where(above, index * torch.sign(log_ratio).to(torch.long), 0)


def mismatch_sums(logprobs: torch.Tensor, behaviour: torch.Tensor) -> dict[str, float]:
    """The mergeable stats of (N,) learner `logprobs` against the engine's `behaviour`:
    `mismatch_abs_sum`, `mismatch_abs_max`, and per bin k that holds a token
    `ratio_bin_count:k` and `ratio_bin_sum:k` (the count and sum of its d)."""
    with torch.no_grad():
        log_ratio = (logprobs.to(torch.float64) - behaviour.to(logprobs.device, torch.float64))
        if not log_ratio.numel():
            return {}
        stats = {"mismatch_abs_sum": float(log_ratio.abs().sum()),
                 "mismatch_abs_max": float(log_ratio.abs().max())}
        bins = ratio_bins(log_ratio).cpu()
        log_ratio = log_ratio.cpu()
        present, inverse = torch.unique(bins, return_inverse=True)
        counts = torch.bincount(inverse, minlength=present.numel())
        sums = torch.zeros(present.numel(), dtype=torch.float64).index_add_(0, inverse, log_ratio)
        for k, count, total in zip(present.tolist(), counts.tolist(), sums.tolist(), strict=True):
            stats[f"{COUNT_KEY}{k}"] = float(count)
            stats[f"{SUM_KEY}{k}"] = total
        return stats


def version_gap_sums(version_gap: torch.Tensor) -> dict[str, float]:
    """The mergeable counts of (N,) long version gaps (how many versions the weights that
    sampled a token are behind those the step trains): `num_version_gap:k` for k = 0, 1,
    2, and `num_version_gap:3` for 3 or more."""
    last = len(GAP_FRACTIONS) - 1
    counts = torch.bincount(version_gap.cpu().clamp(max=last), minlength=last + 1)
    return {f"{GAP_KEY}{k}": float(count) for k, count in enumerate(counts.tolist())}


def ratio_quantiles(stats: dict[str, float]) -> dict[str, float]:
    """`QUANTILES` of the train/sample ratio from the merged histogram (empty if none).
    A quantile q is the nearest-rank one (the smallest d with at least q*N of the d_t at
    or below it), read as exp of the mean d of its bin: exact when that bin's tokens
    share one value, and always within the bin, i.e. within 12% of d (or of BIN_FLOOR):
    a ratio of 1.002 is told from 1.0023, not from 1.00201."""
    bins = sorted((int(key[len(COUNT_KEY):]), count) for key, count in stats.items()
                  if key.startswith(COUNT_KEY) and count > 0)
    total = sum(count for _, count in bins)
    quantiles = {}
    for name, q in QUANTILES.items():
        rank, seen = max(1, math.ceil(q * total - 1e-9)), 0.0
        for k, count in bins:
            seen += count
            if seen >= rank:
                quantiles[name] = math.exp(stats[f"{SUM_KEY}{k}"] / count)
                break
    return quantiles


def mismatch_metrics(stats: dict[str, float]) -> dict[str, float]:
    """The step's mismatch and masking metrics from its merged stats (see
    `metrics_log.py`); empty where the step had no term."""
    num_terms = stats.get("num_terms", 0.0)
    if not num_terms:
        return {}
    metrics = {"mismatch_mean": stats.get("mismatch_abs_sum", 0.0) / num_terms,
               "mismatch_max": stats.get("mismatch_abs_max", 0.0),
               "masked_fraction": stats.get("num_dropped", 0.0) / num_terms,
               **ratio_quantiles(stats)}
    for stat, metric in (("num_sequence_masked", "sequence_masked_fraction"),
                         ("num_version_masked", "version_masked_fraction")):
        if stats.get(stat) is not None:
            metrics[metric] = stats[stat] / num_terms
    for k, metric in enumerate(GAP_FRACTIONS):
        if stats.get(f"{GAP_KEY}{k}") is not None:
            metrics[metric] = stats[f"{GAP_KEY}{k}"] / num_terms
    return metrics
