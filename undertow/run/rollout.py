"""`undertow rollout`: load tasks, pick the scaffold, reach or start a gateway, run.

Against a running gateway (`--gateway URL`, admin token from the command line's
environment) or an embedded one (built-in engine + gateway for this run; the model
directory is `--model`, or the tiny model built once under the output folder).
Prints progress while it runs, then the summary table; `summary.json` is written next
to the sessions' folders. Ctrl-C stops cleanly (sessions closed, containers removed).
"""

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RolloutCommand:
    """Everything `undertow rollout` was given."""

    tasks: Path
    scaffold: str
    group_size: int = 1
    concurrency: int = 1
    timeout_s: float = 600.0
    gateway_url: str | None = None
    admin_token: str = ""
    model_dir: Path | None = None
    engine_urls: tuple[str, ...] = ()
    out_dir: Path = Path("runs/rollouts")
    instance_ids: tuple[str, ...] = ()
    num_tasks: int | None = None
    scaffold_options: dict[str, Any] = field(default_factory=dict)
    timeout_value: str = "partial_credit"
    docker_url: str | None = None
    progress_interval_s: float = 5.0


def select_tasks(command: RolloutCommand) -> list:
    from undertow.run.rollout_source import choose_tasks
    from undertow.sandboxes.task import load_tasks

    return choose_tasks(load_tasks(command.tasks), command.instance_ids, command.num_tasks,
                        command.tasks)


def _model_dir(command: RolloutCommand) -> Path:
    if command.model_dir is not None:
        return command.model_dir
    from undertow.learner.modeldir import ensure_model_dir

    return ensure_model_dir(command.out_dir / "model-tiny")


@contextlib.asynccontextmanager
async def _gateway(command: RolloutCommand, run_dir: Path):
    if command.gateway_url:
        yield command.gateway_url, command.admin_token
        return
    from undertow.run.embedded import embedded_gateway

    run_dir.mkdir(parents=True, exist_ok=True)
    async with embedded_gateway(_model_dir(command), run_dir / "store",
                                command.engine_urls) as gateway:
        print(f"embedded gateway at {gateway.url} (engines {', '.join(gateway.engine_urls)})",
              flush=True)
        yield gateway.url, gateway.admin_token


async def run_rollout(command: RolloutCommand):
    """Runs the rollout; returns its `RolloutSummary`."""
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.adapters.registry import create_scaffold
    from undertow.adapters.rollout import Rollout, RolloutConfig, new_run_id
    from undertow.sandboxes.connection import connect
    from undertow.sandboxes.grading import GradingConfig

    tasks = select_tasks(command)
    scaffold = create_scaffold(command.scaffold, command.scaffold_options)
    run_id = new_run_id()
    # Each graded diff's whole test log is kept, so the official harness can judge the same
    # log (`<run>/test-logs/<instance_id>/<diff_key(diff)>.log`).
    grading = GradingConfig(log_dir=command.out_dir / run_id / "test-logs")
    config = RolloutConfig(group_size=command.group_size, concurrency=command.concurrency,
                           timeout_s=command.timeout_s, out_dir=command.out_dir,
                           run_id=run_id, timeout_value=command.timeout_value,
                           progress_interval_s=command.progress_interval_s, grading=grading)
    async with _gateway(command, command.out_dir / config.run_id / "gateway") as (url, token):
        with connect(command.docker_url) as connection:
            async with GatewayAdmin(url, token) as admin:
                await admin.health()
                return await Rollout(tasks, scaffold, admin, connection, config).run()


async def _until_terminated(command: RolloutCommand):
    """`run_rollout`, cancelled by a SIGTERM as Ctrl-C cancels it (asyncio.run's SIGINT
    handler), so that a stopped rollout closes its sessions and removes its containers
    (the default action would end the process at once and leave both behind)."""
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    return await run_rollout(command)


def main(command: RolloutCommand) -> int:
    try:
        summary = asyncio.run(_until_terminated(command))
    except (KeyboardInterrupt, asyncio.CancelledError) as stop:
        print("rollout interrupted: sessions closed, containers removed", flush=True)
        # A Docker call still running in a worker thread (a task image's first build takes
        # minutes) would hold the interpreter's exit until it ended, though nothing waits
        # for its answer: leave now (the daemon finishes or drops the build on its own).
        sys.stderr.flush()
        os._exit(130 if isinstance(stop, KeyboardInterrupt) else 128 + signal.SIGTERM)
    print(summary.table())
    print(f"summary: {command.out_dir / summary.run_id / 'summary.json'}")
    return 0
