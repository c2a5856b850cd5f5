"""Task validation (`undertow tasks validate`): does each task's gold patch decide its tests,
every time? What is checked: docs/sandboxes.md#task-sets-that-ship-their-repositories.
"""

import asyncio
import time
from dataclasses import dataclass

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import SandboxError
from undertow.sandboxes.grading import Grade, GradingConfig, grade
from undertow.sandboxes.log_parsers import is_passing
from undertow.sandboxes.swebench_harness import SWEBENCH_PARSER
from undertow.sandboxes.task import Task
from undertow.sandboxes.task_image import compute_base_commit, ensure_task_image


@dataclass(frozen=True)
class TaskCheck:
    """The verdict on one task: `ok` iff `problems` is empty. `decided_by` names the side
    whose parser and rules judged its logs: "swebench" or "undertow"."""

    instance_id: str
    num_runs: int
    problems: tuple[str, ...]
    duration_s: float
    decided_by: str = "undertow"

    @property
    def ok(self) -> bool:
        return not self.problems


def _problems(task: Task, without: Grade, with_gold: Grade) -> list[str]:
    problems = []
    for test in task.FAIL_TO_PASS:
        if is_passing(without.tests[test]):
            problems.append(f"FAIL_TO_PASS {test} passes without the gold patch")
        if not is_passing(with_gold.tests[test]):
            problems.append(f"FAIL_TO_PASS {test} is {with_gold.tests[test]} with the gold patch")
    for test in task.PASS_TO_PASS:
        for label, verdict in (("without", without), ("with", with_gold)):
            if not is_passing(verdict.tests[test]):
                problems.append(f"PASS_TO_PASS {test} is {verdict.tests[test]} {label} the gold "
                                "patch")
    return problems


async def _stamp_problem(connection: Connection, task: Task) -> list[str]:
    computed = await connection.call(compute_base_commit, task)
    if computed == task.base_commit:
        return []
    return [f"base_commit {task.base_commit or '(empty)'} is not {computed}, the hash its "
            "source gives: run `undertow tasks stamp` on the task set"]


async def validate_task(connection: Connection, task: Task, *, run: str,
                        num_runs: int = 3) -> TaskCheck:
    started = time.monotonic()
    problems: list[str] = [] if task.FAIL_TO_PASS else ["no FAIL_TO_PASS tests"]
    config = GradingConfig(partial_credit="never")
    seen: dict[str, set[tuple[str, str]]] = {}
    try:
        if task.image is None:
            problems.extend(await _stamp_problem(connection, task))
        image = await ensure_task_image(connection, task)
        for _ in range(num_runs):
            without = await grade(connection, task, "", run=run, config=config, image=image)
            with_gold = await grade(connection, task, task.patch, run=run, config=config,
                                    image=image)
            if "does not apply" in with_gold.reason:
                problems.append(f"gold patch: {with_gold.reason}")
                break
            problems.extend(p for p in _problems(task, without, with_gold) if p not in problems)
            for test in without.tests:
                seen.setdefault(test, set()).add((without.tests[test], with_gold.tests[test]))
    except SandboxError as error:
        problems.append(str(error))
    problems.extend(f"flaky: {test} varies between runs {sorted(outcomes)}"
                    for test, outcomes in seen.items() if len(outcomes) > 1)
    decided_by = "swebench" if task.log_parser.startswith(SWEBENCH_PARSER) else "undertow"
    return TaskCheck(task.instance_id, num_runs, tuple(problems), time.monotonic() - started,
                     decided_by)


async def validate_tasks(connection: Connection, tasks: list[Task], *, run: str,
                         num_runs: int = 3, concurrency: int = 2) -> list[TaskCheck]:
    """Validates every task, at most `concurrency` at once; results in the tasks' order."""
    gate = asyncio.Semaphore(concurrency)

    async def check(task: Task) -> TaskCheck:
        async with gate:
            return await validate_task(connection, task, run=run, num_runs=num_runs)

    return list(await asyncio.gather(*(check(task) for task in tasks)))


def format_checks(checks: list[TaskCheck]) -> str:
    """A Markdown table of the checks, one row per task."""
    rows = ["| task | verdict | decided by | runs | seconds | problems |",
            "| --- | --- | --- | --- | --- | --- |"]
    for check in checks:
        verdict = "ok" if check.ok else "FAIL"
        rows.append(f"| {check.instance_id} | {verdict} | {check.decided_by} | {check.num_runs} "
                    f"| {check.duration_s:.1f} | {'; '.join(check.problems)} |")
    num_ok = sum(check.ok for check in checks)
    by_swebench = sum(check.decided_by == "swebench" for check in checks)
    rows.append(f"\n{num_ok}/{len(checks)} tasks valid; verdicts decided by swebench for "
                f"{by_swebench}, by undertow for {len(checks) - by_swebench}")
    return "\n".join(rows)
