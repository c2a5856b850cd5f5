"""What `undertow train` prints about a run, with or without a cell pool: one progress line
per step (`metrics_log.format_step` of the step's metrics record) and, at the end, the
reward curve's PNG, the checkpoint and the command that evaluates it. Used by
`undertow/run/train.py`; it imports no run module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from undertow.run.rollout_source import CHAT
from undertow.run.sections import RolloutSection


def step_printer(num_steps: int) -> Callable[[dict[str, Any]], None]:
    """Prints each step's metrics record as one progress line."""
    from undertow.learner.metrics_log import format_step

    return lambda record: print(f"undertow train: {format_step(record, num_steps)}", flush=True)


def print_results(run_dir: Path, rollout: RolloutSection) -> None:
    """At the end of a run: the reward curve's PNG, the checkpoint and how to evaluate it."""
    from undertow.learner.checkpoint import latest_checkpoint

    try:
        from undertow.learner.plot import plot_run

        reward_png = next(p for p in plot_run(run_dir) if p.name == "reward.png")
        print(f"undertow train: reward curve {reward_png}", flush=True)
    except (ImportError, FileNotFoundError) as error:
        print(f"undertow train: no plot ({error}); `undertow plot {run_dir}` draws it")
    print(f"undertow train: see the run in a browser with: undertow ui --runs {run_dir}",
          flush=True)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return
    print(f"undertow train: checkpoint {checkpoint}", flush=True)
    if rollout.source:   # a plugged-in rollout: how to evaluate it is its own business
        return
    if rollout.scaffold == CHAT:
        tasks = f" --tasks {rollout.tasks}" if rollout.tasks else ""
        print(f"undertow train: evaluate it with: undertow chat-eval --model "
              f"{checkpoint / 'model'}{tasks}", flush=True)
    else:
        tasks = f" --tasks {rollout.tasks}" if rollout.tasks else ""
        print(f"undertow train: evaluate it with: undertow eval --model {checkpoint / 'model'}"
              f" --scaffold {rollout.scaffold}{tasks}", flush=True)
