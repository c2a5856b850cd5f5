"""The cells' roles over time, one row per cell, drawn with matplotlib's Agg backend."""

from pathlib import Path

from undertow.cells import Role
from undertow.cells.sim.results import SimResult

COLOURS = {Role.ROLLOUT: "#4C72B0", Role.TRAINING: "#DD8452", Role.SWITCHING: "#8C8C8C"}


def plot_timeline(results: list[SimResult], out: Path, max_hours: float | None = None) -> Path:
    """Draw one panel per result (same time axis, hours) and write a PNG to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 1, squeeze=False, sharex=True,
                                figsize=(11, 1.2 + 0.28 * sum(r.num_cells for r in results)))
    for ax, result in zip(axes[:, 0], results, strict=True):
        for role, colour in COLOURS.items():
            for cell_id in range(result.num_cells):
                bars = [(s.start_s / 3600, (s.end_s - s.start_s) / 3600) for s in result.timeline
                        if s.cell_id == cell_id and s.role is role]
                ax.broken_barh(bars, (cell_id - 0.4, 0.8), facecolors=colour)
        for step in result.steps:
            ax.axvline(step.published_s / 3600, color="black", linewidth=0.4, alpha=0.5)
        ax.set_ylabel("cell")
        ax.set_ylim(-0.6, result.num_cells - 0.4)
        ax.set_title(f"{result.policy} on {result.workload}: {result.time_per_step_s:.0f} s/step",
                     fontsize=9)
    if max_hours is not None:
        axes[-1, 0].set_xlim(0, max_hours)
    axes[-1, 0].set_xlabel("hours (vertical lines: weights published)")
    figure.legend(handles=[mpatches.Patch(color=c, label=r.value) for r, c in COLOURS.items()],
                  loc="upper right", ncol=3, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
