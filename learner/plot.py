"""`undertow plot RUN`: the run's per-step metrics (`RUN/metrics.jsonl`) drawn to PNG files
under `RUN/plots/` (or `--out`), one figure per theme (`reward`, `loss`, `tokens`,
`mismatch`, `time`), each a column of panels over the step axis; matplotlib's file-only Agg
backend.
"""

from __future__ import annotations

from pathlib import Path

from undertow.learner.metrics_log import read_metrics

FIGURES = {
    "reward": (("reward_mean", "pass_rate"), ("reward_std",), ("num_cut_sessions",),
               ("num_uniform_groups", "num_dropped_uniform", "num_dropped_invalid",
                "num_dropped_groups", "num_rerun_sessions", "num_infra_failures")),
    "loss": (("loss",), ("kl", "kl_ref"), ("entropy",), ("clip_fraction",), ("grad_norm",)),
    "tokens": (("num_trained_tokens", "num_unique_tokens", "num_flat_tokens"),
               ("unique_flat_ratio",), ("staleness_mean", "staleness_max")),
    "mismatch": (("mismatch_mean", "mismatch_max"), ("ratio_p5", "ratio_p50", "ratio_p95"),
                 ("masked_fraction", "sequence_masked_fraction", "version_masked_fraction"),
                 ("version_gap0_fraction", "version_gap1_fraction", "version_gap2_fraction",
                  "version_gap3plus_fraction")),
}


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Writes the PNGs of `run_dir`'s metrics; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(f"{Path(run_dir) / 'metrics.jsonl'} holds no step yet; "
                                "plot a run that has trained at least one step")
    out_dir = Path(out_dir or Path(run_dir) / "plots")
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []
    for name, panels in FIGURES.items():
        figure, axes = pyplot.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)),
                                       sharex=True, squeeze=False)
        for axis, keys in zip(axes[:, 0], panels, strict=True):
            for key in keys:
                points = [(s, r[key]) for s, r in zip(steps, records, strict=True) if key in r]
                if points:
                    axis.plot(*zip(*points, strict=True), marker="o", label=key)
            axis.legend(loc="best", fontsize="small")
            axis.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        written.append(_save(figure, pyplot, out_dir / f"{name}.png"))
    written.append(_plot_time(records, steps, pyplot, out_dir / "time.png"))
    return written


def _plot_time(records, steps, pyplot, path: Path) -> Path:
    figure, axis = pyplot.subplots(figsize=(7, 3))
    bottom = [0.0] * len(records)
    for key in ("rollout_s", "train_s", "sync_s"):
        values = [r.get(key, 0.0) for r in records]
        axis.bar(steps, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set_xlabel("step")
    axis.set_ylabel("seconds")
    axis.legend(loc="best", fontsize="small")
    return _save(figure, pyplot, path)


def _save(figure, pyplot, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
