"""`undertow plot RUN`: a training run's `metrics.jsonl` drawn to PNG files
(`learner/plot.py`); it prints each file's path."""

import argparse
from pathlib import Path

from undertow.commands import Commands


def add(commands: Commands) -> None:
    plot = commands.add_parser("plot", help="draw a training run's metrics to PNG files")
    plot.add_argument("run", type=Path, help="run directory (holding metrics.jsonl)")
    plot.add_argument("--out", type=Path, default=None, help="folder (default: RUN/plots)")
    plot.set_defaults(handler=_plot)


def _plot(args: argparse.Namespace) -> int:
    from undertow.learner.plot import plot_run

    for path in plot_run(args.run, args.out):
        print(path)
    return 0
