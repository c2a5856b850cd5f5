"""What `undertow sandbox ...` and `undertow tasks ...` do; `undertow/cli.py` parses the flags.

Each function takes plain values (the command line reads the environment, e.g.
DOCKER_HOST, and passes it in), prints its outcome and returns an exit status.
"""

import asyncio
import functools
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec

from undertow.sandboxes.connection import DEFAULT_DOCKER_URL, connect
from undertow.sandboxes.errors import SandboxError

P = ParamSpec("P")


def _reported(command: Callable[P, int]) -> Callable[P, int]:
    """Prints a SandboxError's message (it says what to do) instead of a traceback."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            return command(*args, **kwargs)
        except SandboxError as error:
            print(f"undertow: error: {error}", file=sys.stderr)
            return 1

    return run


@_reported
def build_base(docker_url: str | None, mirror: str | None, cache_dir: Path | None) -> int:
    from undertow.sandboxes.base_image import build_base_image

    with connect(docker_url) as connection:
        image = asyncio.run(build_base_image(connection, cache_dir=cache_dir, mirror=mirror))
    verb = "reusing existing" if image.reused else "built"
    print(f"{verb} base image {image.tag} ({image.image_id[:19]})")
    return 0


@_reported
def collect_garbage(docker_urls: list[str | None], run: str | None, orphans_only: bool) -> int:
    """Clears every daemon of `docker_urls` (None: the local socket); 1 if one did not answer."""
    from undertow.sandboxes.hosts import DockerHosts, HostsConfig

    urls = tuple(dict.fromkeys(url or DEFAULT_DOCKER_URL for url in docker_urls))
    with DockerHosts.connect(HostsConfig(docker_hosts=urls)) as hosts:
        counts = asyncio.run(hosts.gc(run, orphans_only))
    which = " orphaned" if orphans_only else ""
    of_run = f" of run {run}" if run else ""
    for url, count in counts.items():
        where = f" on {url}" if len(counts) > 1 else ""
        if isinstance(count, str):
            print(f"undertow: error: could not clear {url}: {count}", file=sys.stderr)
        else:
            print(f"removed {count}{which} sandbox container(s){of_run}{where}")
    return 1 if any(isinstance(count, str) for count in counts.values()) else 0


@_reported
def stamp(folder: Path, check_only: bool) -> int:
    from undertow.sandboxes.taskset import check_stamps, stamp_task_set

    stamps = check_stamps(folder) if check_only else stamp_task_set(folder)
    wrong = [s for s in stamps if not s.matches]
    for item in wrong:
        action = "is stale" if check_only else "updated"
        print(f"{item.instance_id}: base_commit {item.recorded or '(empty)'} {action} -> "
              f"{item.computed}")
    print(f"{len(stamps) - len(wrong)}/{len(stamps)} base commits were already right")
    return 1 if check_only and wrong else 0


@_reported
def validate(docker_url: str | None, folder: Path, num_runs: int, concurrency: int,
             instance_ids: list[str] | None) -> int:
    from undertow.sandboxes.sandbox import gc
    from undertow.sandboxes.task import load_tasks
    from undertow.sandboxes.validation import format_checks, validate_tasks

    tasks = load_tasks(folder)
    if instance_ids:
        tasks = [task for task in tasks if task.instance_id in instance_ids]
    run = f"validate-{uuid.uuid4().hex[:8]}"

    async def main():
        with connect(docker_url) as connection:
            try:
                return await validate_tasks(connection, tasks, run=run, num_runs=num_runs,
                                            concurrency=concurrency)
            finally:
                await gc(connection, run)

    checks = asyncio.run(main())
    print(format_checks(checks))
    return 0 if checks and all(check.ok for check in checks) else 1
