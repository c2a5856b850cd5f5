"""Sandboxes on this machine: start-to-ready time, grading time per task, and capacity.

    python -m benchmarks.sandboxes [--num-starts 10] [--max-sessions 128] [--num-tasks 0]

1. start-to-ready: a session's container from `Sandbox.start` until a command has run in it,
   then `close()` (removal), each timed over `--num-starts` sequential sessions; plus the
   latency of one `exec`.
2. grading: `grade()` of the gold patch on each bundled task (fresh container, apply, tests),
   or the first `--num-tasks` of them (0 = all).
3. capacity: sessions' containers started in batches of 8 and held, until a start fails, the
   host's available memory falls under a quarter of its total, or `--max-sessions`; then one
   command runs in each (all must answer) and all are removed.

Writes benchmarks/results/sandboxes.json and prints Markdown tables.
"""

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path

from undertow.sandboxes.base_image import build_base_image
from undertow.sandboxes.connection import Connection, connect
from undertow.sandboxes.errors import SandboxError
from undertow.sandboxes.grading import grade
from undertow.sandboxes.sandbox import Sandbox, gc
from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import ensure_task_image
from undertow.sandboxes.taskset import BUNDLED_DIR

RESULTS_DIR = Path(__file__).parent / "results"
BATCH = 8


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"n": len(values), "p50_s": statistics.median(ordered), "min_s": ordered[0],
            "max_s": ordered[-1], "mean_s": statistics.fmean(ordered)}


def _available_bytes() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemAvailable"].split()[0]) * 1024,
            int(fields["MemTotal"].split()[0]) * 1024)


async def measure_start(connection: Connection, image: str, run: str, num_starts: int) -> dict:
    ready, closing, execs = [], [], []
    for index in range(num_starts):
        started = time.perf_counter()
        box = await Sandbox.start(connection, image, run=run, session=f"start-{index}",
                                  workdir="/home/agent")
        ready.append(time.perf_counter() - started)
        try:
            result = await box.exec("echo ready", timeout_s=30)
            execs.append(result.duration_s)
        finally:
            started = time.perf_counter()
            await box.close()
            closing.append(time.perf_counter() - started)
    return {"start_to_ready": _summary(ready), "exec_echo": _summary(execs),
            "close": _summary(closing)}


async def measure_grading(connection: Connection, run: str, num_tasks: int) -> dict:
    if not (BUNDLED_DIR / "tasks.jsonl").exists():
        return {"skipped": "no bundled tasks.jsonl"}
    tasks = load_tasks(BUNDLED_DIR)
    tasks = tasks[:num_tasks] if num_tasks else tasks
    per_task = {}
    for task in tasks:
        image = await ensure_task_image(connection, task)
        verdict = await grade(connection, task, task.patch, run=run, image=image)
        per_task[task.instance_id] = {"grading_s": verdict.duration_s, "reward": verdict.reward}
    return {"per_task": per_task,
            "grading": _summary([entry["grading_s"] for entry in per_task.values()])}


async def measure_capacity(connection: Connection, image: str, run: str,
                           max_sessions: int) -> dict:
    boxes: list[Sandbox] = []
    available_before, total = _available_bytes()
    stopped_by = f"the bound of {max_sessions} sessions"
    started = time.perf_counter()
    try:
        while len(boxes) < max_sessions:
            batch = await asyncio.gather(*(
                Sandbox.start(connection, image, run=run, session=f"hold-{len(boxes) + i}",
                              workdir="/home/agent")
                for i in range(min(BATCH, max_sessions - len(boxes)))), return_exceptions=True)
            boxes.extend(box for box in batch if isinstance(box, Sandbox))
            failures = [box for box in batch if not isinstance(box, Sandbox)]
            if failures:
                stopped_by = f"a start failed: {failures[0]}"
                break
            if _available_bytes()[0] < total // 4:
                stopped_by = "host memory available fell under 25%"
                break
        start_all_s = time.perf_counter() - started
        available_after = _available_bytes()[0]
        answers = await asyncio.gather(*(box.exec("echo alive", timeout_s=120) for box in boxes),
                                       return_exceptions=True)
        num_alive = sum(1 for a in answers if not isinstance(a, BaseException)
                        and a.output == "alive\n")
    finally:
        await asyncio.gather(*(box.close() for box in boxes), return_exceptions=True)
        await gc(connection, run)
    num_held = len(boxes)
    return {"num_held": num_held, "num_answering": num_alive, "stopped_by": stopped_by,
            "start_all_s": start_all_s,
            "host_bytes_per_session": (available_before - available_after) / max(num_held, 1)}


def format_tables(results: dict) -> str:
    start = results["start"]
    lines = ["| sandbox measure | p50 | min | max |", "| --- | --- | --- | --- |"]
    for name in ("start_to_ready", "exec_echo", "close"):
        s = start[name]
        lines.append(f"| {name} (s, n={s['n']}) | {s['p50_s']:.3f} | {s['min_s']:.3f} | "
                     f"{s['max_s']:.3f} |")
    grading = results["grading"]
    if "grading" in grading:
        s = grading["grading"]
        lines.append(f"| grade gold patch per task (s, n={s['n']}) | {s['p50_s']:.3f} | "
                     f"{s['min_s']:.3f} | {s['max_s']:.3f} |")
    capacity = results["capacity"]
    lines += ["", "| capacity | value |", "| --- | --- |",
              f"| sessions' containers held at once | {capacity['num_held']} |",
              f"| of which answered a command | {capacity['num_answering']} |",
              f"| stopped by | {capacity['stopped_by']} |",
              f"| time to start them all (s) | {capacity['start_all_s']:.1f} |",
              f"| host memory per held container (MiB) | "
              f"{capacity['host_bytes_per_session'] / 2**20:.1f} |"]
    return "\n".join(lines)


async def run_benchmark(args) -> dict:
    run = f"bench-{uuid.uuid4().hex[:8]}"
    with connect() as connection:
        try:
            image = (await build_base_image(connection)).tag
            results = {
                "start": await measure_start(connection, image, run, args.num_starts),
                "grading": await measure_grading(connection, run, args.num_tasks),
                "capacity": await measure_capacity(connection, image, run, args.max_sessions),
            }
        except SandboxError:
            await gc(connection, run)
            raise
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-starts", type=int, default=10)
    parser.add_argument("--max-sessions", type=int, default=128)
    parser.add_argument("--num-tasks", type=int, default=0, help="0 grades every bundled task")
    args = parser.parse_args()
    results = asyncio.run(run_benchmark(args))
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "sandboxes.json").write_text(json.dumps(results, indent=2))
    print(format_tables(results))


if __name__ == "__main__":
    main()
