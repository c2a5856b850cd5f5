"""`undertow eval`: pass@1 and pass@k of a checkpoint on a task set, and a paired comparison.

A run gives each task n sessions (n >= k), c of them resolved. Per task:
pass@k = 1 - C(n-c, k) / C(n, k), the unbiased estimator of Chen et al. (2021, "Evaluating
Large Language Models Trained on Code"), computed as a product so that it never overflows;
its 95% interval for pass@1 is Wilson's score interval on c of n (and the difference of
two independent pass rates has Newcombe's interval, built from theirs: `difference_interval`).
Overall: the mean over tasks, with a 95% interval from the spread across tasks (mean ± 1.96
standard errors, clipped to [0, 1]). Sessions that Undertow itself failed to run or grade (cause
`error:<stage>`) are no outcome of the model and are left out (and counted).

Two checkpoints on the same tasks: per task, the difference of pass@1 (B - A); its mean
with a 95% interval, wins/losses/ties, and the two-sided p-value of a paired sign-flip
permutation test (exact over every sign pattern up to 16 tasks, else 100,000 seeded
random patterns).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

Z_95 = 1.959964
_EXACT_MAX_TASKS = 16
_NUM_RANDOM_FLIPS = 100_000


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={num_samples}, "
                         f"c={num_correct}, k={k}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1,
                                                       num_samples + 1))


def wilson_interval(num_correct: int, num_samples: int) -> tuple[float, float]:
    """Wilson's 95% score interval of a proportion."""
    if num_samples == 0:
        return 0.0, 1.0
    p = num_correct / num_samples
    denominator = 1 + Z_95 ** 2 / num_samples
    centre = (p + Z_95 ** 2 / (2 * num_samples)) / denominator
    half = Z_95 * math.sqrt(p * (1 - p) / num_samples + Z_95 ** 2 / (4 * num_samples ** 2))
    return max(0.0, centre - half / denominator), min(1.0, centre + half / denominator)


def difference_interval(num_correct_a: int, num_samples_a: int, num_correct_b: int,
                        num_samples_b: int) -> tuple[float, float]:
    """95% interval of p_b - p_a for two independent proportions: Newcombe's (1998) hybrid
    score interval, built from each proportion's Wilson interval (his method 10)."""
    p_a, p_b = num_correct_a / num_samples_a, num_correct_b / num_samples_b
    low_a, high_a = wilson_interval(num_correct_a, num_samples_a)
    low_b, high_b = wilson_interval(num_correct_b, num_samples_b)
    difference = p_b - p_a
    return (difference - math.sqrt((p_b - low_b) ** 2 + (high_a - p_a) ** 2),
            difference + math.sqrt((high_b - p_b) ** 2 + (p_a - low_a) ** 2))


def mean_interval(values: list[float]) -> tuple[float, float]:
    """Mean ± 1.96 standard errors (0 width for one value), clipped to [0, 1]."""
    mean = float(np.mean(values))
    half = Z_95 * float(np.std(values, ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else 0
    return max(0.0, mean - half), min(1.0, mean + half)


@dataclass(frozen=True)
class TaskScore:
    """One task's n sessions, c resolved, pass@1, pass@k and the Wilson interval of pass@1."""

    instance_id: str
    num_samples: int
    num_correct: int
    pass_at_1: float
    pass_at_k: float
    pass_at_1_interval: tuple[float, float]


@dataclass(frozen=True)
class EvalResult:
    """A checkpoint's scores: per task, and overall with 95% intervals."""

    label: str
    k: int
    tasks: list[TaskScore]
    pass_at_1: float
    pass_at_k: float
    pass_at_1_interval: tuple[float, float]
    pass_at_k_interval: tuple[float, float]
    num_left_out: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def outcomes(summary: dict[str, Any]) -> tuple[dict[str, list[bool]], int]:
    """Per task, whether each of its sessions resolved it; and the sessions left out."""
    per_task: dict[str, list[bool]] = {}
    num_left_out = 0
    for session in summary["sessions"]:
        if str(session.get("cause", "")).startswith("error:"):
            num_left_out += 1
            continue
        per_task.setdefault(session["instance_id"], []).append(bool(session["resolved"]))
    return per_task, num_left_out


def evaluate(per_task: dict[str, list[bool]], k: int, label: str = "",
             num_left_out: int = 0) -> EvalResult:
    """pass@1 and pass@k per task and overall (module docstring)."""
    if not per_task:
        raise ValueError("no sessions to evaluate")
    short = sorted(t for t, results in per_task.items() if len(results) < k)
    if short:
        raise ValueError(f"pass@{k} needs at least {k} sessions per task; {short[:3]} have fewer")
    tasks = [TaskScore(instance_id, len(results), sum(results),
                       pass_at_k(len(results), sum(results), 1),
                       pass_at_k(len(results), sum(results), k),
                       wilson_interval(sum(results), len(results)))
             for instance_id, results in sorted(per_task.items())]
    at_1, at_k = [t.pass_at_1 for t in tasks], [t.pass_at_k for t in tasks]
    return EvalResult(label, k, tasks, float(np.mean(at_1)), float(np.mean(at_k)),
                      mean_interval(at_1), mean_interval(at_k), num_left_out)


@dataclass(frozen=True)
class Comparison:
    """B against A on the tasks both ran: mean pass@1 difference (B - A), its interval,
    wins / losses / ties of B, and the paired permutation test's two-sided p-value."""

    label_a: str
    label_b: str
    num_tasks: int
    mean_difference: float
    interval: tuple[float, float]
    num_wins: int
    num_losses: int
    num_ties: int
    p_value: float


def sign_flip_p_value(differences: np.ndarray, seed: int = 0) -> float:
    """Two-sided p-value of the paired sign-flip permutation test of mean difference 0."""
    observed = abs(differences.mean())
    if len(differences) <= _EXACT_MAX_TASKS:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(differences))))
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice((1.0, -1.0), size=(_NUM_RANDOM_FLIPS, len(differences)))
    means = np.abs((signs * differences).mean(axis=1))
    return float(np.mean(means >= observed - 1e-12))


def compare(a: EvalResult, b: EvalResult) -> Comparison:
    """The paired comparison of two checkpoints' pass@1 on their common tasks."""
    scores_a = {t.instance_id: t.pass_at_1 for t in a.tasks}
    scores_b = {t.instance_id: t.pass_at_1 for t in b.tasks}
    common = sorted(scores_a.keys() & scores_b.keys())
    if not common:
        raise ValueError("the two runs share no task; compare runs on the same task set")
    differences = np.array([scores_b[t] - scores_a[t] for t in common])
    mean = float(differences.mean())
    half = Z_95 * float(differences.std(ddof=1)) / math.sqrt(len(common)) if len(common) > 1 else 0
    return Comparison(a.label, b.label, len(common), mean, (mean - half, mean + half),
                      int((differences > 0).sum()), int((differences < 0).sum()),
                      int((differences == 0).sum()), sign_flip_p_value(differences))


def format_result(result: EvalResult) -> str:
    """A Markdown table: one row per task, then the overall row."""
    k = result.k
    rows = [f"### {result.label or 'eval'}", "",
            f"| task | n | resolved | pass@1 | pass@1 95% CI | pass@{k} |",
            "| --- | --- | --- | --- | --- | --- |"]
    for task in result.tasks:
        low, high = task.pass_at_1_interval
        rows.append(f"| {task.instance_id} | {task.num_samples} | {task.num_correct} | "
                    f"{task.pass_at_1:.3f} | [{low:.3f}, {high:.3f}] | {task.pass_at_k:.3f} |")
    (low_1, high_1), (low_k, high_k) = result.pass_at_1_interval, result.pass_at_k_interval
    rows.append(f"| **all ({len(result.tasks)} tasks)** | | | {result.pass_at_1:.3f} | "
                f"[{low_1:.3f}, {high_1:.3f}] | {result.pass_at_k:.3f} "
                f"[{low_k:.3f}, {high_k:.3f}] |")
    if result.num_left_out:
        rows.append(f"\n{result.num_left_out} sessions left out: Undertow failed to run or "
                    "grade them (cause error:...)")
    return "\n".join(rows)


def format_comparison(comparison: Comparison) -> str:
    low, high = comparison.interval
    return (f"{comparison.label_b} vs {comparison.label_a} on {comparison.num_tasks} tasks: "
            f"pass@1 difference {comparison.mean_difference:+.3f} (95% CI [{low:+.3f}, "
            f"{high:+.3f}]); wins {comparison.num_wins}, losses {comparison.num_losses}, ties "
            f"{comparison.num_ties}; paired sign-flip permutation test p = "
            f"{comparison.p_value:.4f}")
