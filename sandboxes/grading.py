"""Grading: a session's diff judged by the task's tests, in a fresh container.

The flow of `grade`: start a new container from the task's image (the session's
own container may have been tampered with); apply the session's diff (one that
does not apply scores 0 with the reason); restore every file the held-back
`test_patch` touches to its base-commit state, then apply `test_patch` (so tests
the agent edited cannot change the verdict); run `test_cmd` within the task's
`timeout_s`; parse the log with the task's parser; score.

Reward: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes. Otherwise, when
partial credit applies (sessions that hit their time limit, or all sessions if
configured), the fraction of FAIL_TO_PASS tests that pass - 0 if any
PASS_TO_PASS test breaks, unless configured otherwise; else 0.
"""

import re
import shlex
import time
from dataclasses import dataclass, field

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import SandboxError
from undertow.sandboxes.log_parsers import PASSED, get_log_parser
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig
from undertow.sandboxes.task import Task
from undertow.sandboxes.task_image import ensure_task_image

MISSING = "missing"
_PATCH_DIR = "/tmp/undertow-grading"
_PATCH_PATH = re.compile(r"^diff --git a/(.+?) b/(.+)$", re.MULTILINE)
_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class GradingConfig:
    """How a session is scored.

    `partial_credit`: "timeout" gives partial credit only to sessions that hit their
    time limit, "always" to every session, "never" to none. `zero_if_pass_to_pass_breaks`:
    partial credit is 0 when any PASS_TO_PASS test fails.
    """

    partial_credit: str = "timeout"
    zero_if_pass_to_pass_breaks: bool = True
    sandbox: SandboxConfig = field(
        default_factory=lambda: SandboxConfig(max_output_bytes=4 * 2**20))
    apply_timeout_s: float = 60.0

    def __post_init__(self):
        if self.partial_credit not in ("timeout", "always", "never"):
            raise ValueError(f"GradingConfig.partial_credit must be timeout, always or never, "
                             f"got {self.partial_credit!r}")


@dataclass(frozen=True)
class Grade:
    """The verdict on one diff.

    Invariants: 0 <= reward <= 1; `resolved` iff every FAIL_TO_PASS and
    PASS_TO_PASS test passed (then reward == 1); `tests` maps each of those test
    IDs to its status ("passed", "failed", "error", "skipped", or "missing" when the
    log does not report it); `reason` says in words why the reward is what it is.
    """

    reward: float
    resolved: bool
    tests: dict[str, str] = field(default_factory=dict)
    num_fail_to_pass_passed: int = 0
    num_fail_to_pass: int = 0
    broken_pass_to_pass: tuple[str, ...] = ()
    reason: str = ""
    log_tail: str = ""
    duration_s: float = 0.0


def patched_paths(patch: str) -> list[str]:
    """The paths (old and new) that a git diff touches."""
    paths: list[str] = []
    for old, new in _PATCH_PATH.findall(patch):
        paths.extend(path for path in (old, new) if path not in paths)
    return paths


def score(task: Task, statuses: dict[str, str], config: GradingConfig,
          timed_out: bool = False) -> tuple[float, bool, str]:
    """The reward, whether the task is resolved, and why, from per-test statuses."""
    fail_to_pass = [statuses.get(test, MISSING) == PASSED for test in task.FAIL_TO_PASS]
    broken = [test for test in task.PASS_TO_PASS if statuses.get(test, MISSING) != PASSED]
    num_passed = sum(fail_to_pass)
    if num_passed == len(fail_to_pass) and not broken:
        return 1.0, True, "all FAIL_TO_PASS and PASS_TO_PASS tests pass"
    summary = (f"{num_passed}/{len(fail_to_pass)} FAIL_TO_PASS pass, "
               f"{len(broken)} PASS_TO_PASS broken")
    partial = config.partial_credit == "always" or (config.partial_credit == "timeout"
                                                    and timed_out)
    if not partial:
        return 0.0, False, f"not resolved: {summary}"
    if broken and config.zero_if_pass_to_pass_breaks:
        return 0.0, False, f"partial credit 0 because PASS_TO_PASS broke: {summary}"
    reward = num_passed / len(fail_to_pass) if fail_to_pass else 0.0
    return reward, False, f"partial credit: {summary}"


async def _apply(sandbox: Sandbox, patch: str, name: str, timeout_s: float) -> str | None:
    """Applies a patch in the sandbox; returns git's complaint when it does not apply."""
    if not patch.strip():
        return None
    path = f"{_PATCH_DIR}/{name}.diff"
    await sandbox.write_file(path, patch if patch.endswith("\n") else patch + "\n")
    result = await sandbox.exec(
        f"git apply --binary --whitespace=nowarn {path}", timeout_s)
    return None if result.exit_code == 0 else result.output.strip()[-2000:] or "git apply failed"


async def _restore_tests(sandbox: Sandbox, test_patch: str, timeout_s: float) -> None:
    """Puts every file the held-back tests touch back to its base state (or removes it)."""
    base = shlex.quote(sandbox.base_commit)
    commands = [f"(git checkout -q {base} -- {shlex.quote(path)} 2>/dev/null || "
                f"rm -rf -- {shlex.quote(path)})" for path in patched_paths(test_patch)]
    if commands:
        result = await sandbox.exec("; ".join(commands), timeout_s)
        if result.exit_code != 0:
            raise SandboxError(f"could not restore the test files: {result.output}")


async def grade(connection: Connection, task: Task, diff: str, *, run: str,
                config: GradingConfig = GradingConfig(), timed_out: bool = False,
                image: str | None = None) -> Grade:
    """Grades `diff` (a git diff against the task's base commit) in a fresh container."""
    started = time.monotonic()
    parser = get_log_parser(task.log_parser)
    image = image or await ensure_task_image(connection, task)
    session = f"grade-{task.instance_id}"
    async with await Sandbox.start(connection, image, run=run, session=session,
                                   workdir=task.workdir, base_commit=task.base_commit,
                                   config=config.sandbox) as sandbox:
        problem = await _apply(sandbox, diff, "session", config.apply_timeout_s)
        if problem is not None:
            return Grade(0.0, False, reason=f"the diff does not apply: {problem}",
                         num_fail_to_pass=len(task.FAIL_TO_PASS),
                         duration_s=time.monotonic() - started)
        await _restore_tests(sandbox, task.test_patch, config.apply_timeout_s)
        problem = await _apply(sandbox, task.test_patch, "tests", config.apply_timeout_s)
        if problem is not None:
            raise SandboxError(f"task {task.instance_id}: its test_patch does not apply to the "
                               f"base commit: {problem}; fix the task")
        result = await sandbox.exec(task.test_cmd, task.timeout_s)
    statuses = parser(result.output)
    tests = {test: statuses.get(test, MISSING) for test in (*task.FAIL_TO_PASS, *task.PASS_TO_PASS)}
    reward, resolved, reason = score(task, statuses, config, timed_out)
    if result.timed_out:
        reason += f" (the tests ran past {task.timeout_s:g} s and were stopped)"
    return Grade(
        reward=reward, resolved=resolved, tests=tests,
        num_fail_to_pass_passed=sum(tests[test] == PASSED for test in task.FAIL_TO_PASS),
        num_fail_to_pass=len(task.FAIL_TO_PASS),
        broken_pass_to_pass=tuple(t for t in task.PASS_TO_PASS if tests[t] != PASSED),
        reason=reason, log_tail=result.output[-_LOG_TAIL_CHARS:],
        duration_s=time.monotonic() - started)
