"""Per-step metrics of a training run, one JSON object per line in `RUN/metrics.jsonl`;
what each field means: docs/training.md, "What a line of `RUN/metrics.jsonl` holds".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"

STEP_FIELDS = (
    "reward_mean", "reward_std", "pass_rate", "loss", "kl", "kl_ref", "entropy",
    "clip_fraction", "grad_norm", "mismatch_mean", "mismatch_max", "ratio_p5", "ratio_p50",
    "ratio_p95", "masked_fraction", "sequence_masked_fraction", "version_masked_fraction",
    "version_gap0_fraction", "version_gap1_fraction", "version_gap2_fraction",
    "version_gap3plus_fraction", "num_groups", "num_sessions",
    "num_dropped_groups", "num_uniform_groups", "num_cut_sessions",
    "num_dropped_uniform", "num_dropped_invalid", "num_rerun_sessions", "num_infra_failures",
    "infra_failures", "num_trained_tokens",
    "num_unique_tokens", "num_flat_tokens", "unique_flat_ratio", "staleness_mean",
    "staleness_max", "rollout_s", "train_s", "sync_s", "step_s", "num_members",
)


class MetricsLog:
    """Appends step records to `RUN/metrics.jsonl`."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drops records of steps after `step` (written after the checkpoint resumed from)."""
        kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, step: int, weight_version: int, values: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(values) - set(STEP_FIELDS))
        if unknown:
            raise ValueError(f"unknown metric(s) {unknown}; add them to STEP_FIELDS")
        record = {"step": step, "weight_version": weight_version,
                  **{k: values[k] for k in STEP_FIELDS if values.get(k) is not None}}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return record


def format_step(record: dict[str, Any], num_steps: int | None = None) -> str:
    """One progress line of a step's record (what `undertow train` prints per step)."""
    def number(key: str, spec: str) -> str:
        value = record.get(key)
        if key == "kl" and value is not None:
            value = max(value, 0.0)   # k3 is >= 0; rounding can print "-0.0000"
        return "-" if value is None else format(value, spec)

    failures = record.get("infra_failures") or {}
    failed = ", ".join(f"{cause} {n}" for cause, n in sorted(failures.items())) or "0"
    total = f"/{num_steps}" if num_steps else ""
    uniform = record.get("num_uniform_groups")
    warning = (" · every group uniform: nothing to learn"
               if uniform and uniform == record.get("num_groups") else "")
    return (f"step {record['step']}{total} · reward {number('reward_mean', '.3f')} "
            f"± {number('reward_std', '.3f')} · pass {number('pass_rate', '.0%')} · "
            f"dropped uniform {record.get('num_dropped_uniform', 0)}, invalid "
            f"{record.get('num_dropped_invalid', 0)}, stale {record.get('num_dropped_groups', 0)}"
            f" · re-run {record.get('num_rerun_sessions', 0)} (failed: {failed}) · tokens "
            f"{record.get('num_trained_tokens', 0)} · staleness "
            f"{number('staleness_mean', '.2f')} · kl {number('kl', '.4f')} · entropy "
            f"{number('entropy', '.3f')} · {number('step_s', '.1f')}s{warning}")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run, in order; a torn last line is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
