"""Grading: a session's diff judged by the task's tests in a fresh container (`grade`), by the
official SWE-bench harness's rules (`judge`, `score`). The flow and the rules:
docs/sandboxes.md#grading.
"""

import hashlib
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import SandboxError
from undertow.sandboxes.log_parsers import ERROR, FAILED, SKIPPED, get_log_parser, is_passing
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig
from undertow.sandboxes.swebench_harness import (
    APPLY_FAILED_MARKER,
    END_MARKER,
    START_MARKER,
    SWEBENCH_PARSER,
    TIMEOUT_MARKER,
    holds_verdict,
    is_fail_only,
    official_statuses,
)
from undertow.sandboxes.task import Task
from undertow.sandboxes.task_image import ensure_task_image
from undertow.sandboxes.task_setup import run_start_commands

MISSING = "missing"
_PATCH_DIR = "/tmp/undertow-grading"
_PATCH_PATH = re.compile(r"^diff --git a/(.+?) b/(.+)$", re.MULTILINE)
_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class GradingConfig:
    """How a session is scored.

    `partial_credit`: "timeout" gives partial credit only to sessions that hit their
    time limit, "always" to every session, "never" to none. `zero_if_pass_to_pass_breaks`:
    partial credit is 0 when any PASS_TO_PASS test fails. `log_dir`: where each graded
    diff's whole test log is written (`<instance_id>/<diff_key(diff)>.log`), so that
    another grader (the official harness) can read the same log; None keeps only the
    tail in the Grade. `skipped_fail_to_pass_fails`: a skipped FAIL_TO_PASS test is a
    failure instead of counting neither way. The official 4.x harness counts it neither
    way (so a diff that makes every FAIL_TO_PASS test skip resolves the task, a reward an
    agent can learn to hack); swebench 5.x made it a failure. Off by default, so that
    rewards agree with the 4.x verdicts the parity test checks.
    """

    partial_credit: str = "timeout"
    zero_if_pass_to_pass_breaks: bool = True
    sandbox: SandboxConfig = field(
        default_factory=lambda: SandboxConfig(max_output_bytes=4 * 2**20))
    apply_timeout_s: float = 60.0
    log_dir: Path | None = None
    skipped_fail_to_pass_fails: bool = False

    def __post_init__(self):
        if self.partial_credit not in ("timeout", "always", "never"):
            raise ValueError(f"GradingConfig.partial_credit must be timeout, always or never, "
                             f"got {self.partial_credit!r}")


@dataclass(frozen=True)
class Grade:
    """The verdict on one diff.

    Invariants: 0 <= reward <= 1; `resolved` iff every FAIL_TO_PASS and
    PASS_TO_PASS test passed (then reward == 1); `tests` maps each of those test
    IDs to its status ("passed", "failed", "error", "skipped", "xfailed", or "missing"
    when the log does not report it); `reason` says in words why the reward is what it
    is; `decided_by` is "swebench" when the official harness judged the log, else
    "undertow"; `log_path` is where the whole log was written (GradingConfig.log_dir).
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
    decided_by: str = "undertow"
    log_path: str = ""


@dataclass(frozen=True)
class Verdict:
    """What one test log says about a task: each listed test's status, and the score.

    `found` is False when the log holds no verdict (no markers, tests timed out, or no
    test named); then the reward is 0. `successes` and `failures` are the FAIL_TO_PASS
    and PASS_TO_PASS tests counted each way (skipped tests are in neither).
    """

    statuses: dict[str, str]
    found: bool
    reward: float
    resolved: bool
    reason: str
    decided_by: str
    successes: frozenset[str] = frozenset()
    failures: frozenset[str] = frozenset()


def patched_paths(patch: str) -> list[str]:
    """The paths (old and new) that a git diff touches."""
    paths: list[str] = []
    for old, new in _PATCH_PATH.findall(patch):
        paths.extend(path for path in (old, new) if path not in paths)
    return paths


def diff_key(diff: str) -> str:
    """The name a diff's test log is stored under: a hash of the diff."""
    return hashlib.sha256(diff.encode()).hexdigest()[:16]


def classify_test(test: str, statuses: dict[str, str], fail_only: bool = False,
                  skipped_fails: bool = False) -> str:
    """"success", "failure" or "neither", by the official harness's rules
    (docs/sandboxes.md#grading);
    `fail_only`: only a failed test is a failure, anything else a success (the harness's
    rule for repositories whose parsers report failures only); `skipped_fails`: a skipped
    test is a failure (GradingConfig.skipped_fail_to_pass_fails)."""
    status = statuses.get(test, MISSING)
    if fail_only:
        return "failure" if status == FAILED else "success"
    if is_passing(status):
        return "success"
    failing = (MISSING, FAILED, ERROR, SKIPPED) if skipped_fails else (MISSING, FAILED, ERROR)
    return "failure" if status in failing else "neither"


def _fraction(tests: tuple[str, ...], statuses: dict[str, str], fail_only: bool,
              skipped_fails: bool = False) -> tuple[float, list[str]]:
    outcomes = [classify_test(test, statuses, fail_only, skipped_fails) for test in tests]
    num_counted = sum(outcome != "neither" for outcome in outcomes)
    num_success = outcomes.count("success")
    failed = [test for test, outcome in zip(tests, outcomes, strict=True)
              if outcome == "failure"]
    return (num_success / num_counted if num_counted else 1.0), failed


def score(task: Task, statuses: dict[str, str], config: GradingConfig,
          timed_out: bool = False) -> tuple[float, bool, str]:
    """The reward, whether the task is resolved, and why, from per-test statuses.

    1 when resolved (the FAIL_TO_PASS and PASS_TO_PASS fractions are both 1). Otherwise,
    when partial credit applies (sessions that hit their time limit, or all sessions if
    configured), the FAIL_TO_PASS fraction, or 0 if a PASS_TO_PASS test broke (unless
    configured otherwise); else 0."""
    fail_only = is_fail_only(task.repo, task.log_parser)
    fail_to_pass, _ = _fraction(task.FAIL_TO_PASS, statuses, fail_only,
                                config.skipped_fail_to_pass_fails)
    pass_to_pass, broken = _fraction(task.PASS_TO_PASS, statuses, fail_only)
    if fail_to_pass == 1 and pass_to_pass == 1:
        return 1.0, True, "all FAIL_TO_PASS and PASS_TO_PASS tests pass"
    num_passed = sum(is_passing(statuses.get(test, MISSING)) for test in task.FAIL_TO_PASS)
    summary = (f"{num_passed}/{len(task.FAIL_TO_PASS)} FAIL_TO_PASS pass, "
               f"{len(broken)} PASS_TO_PASS broken")
    partial = config.partial_credit == "always" or (config.partial_credit == "timeout"
                                                    and timed_out)
    if not partial:
        return 0.0, False, f"not resolved: {summary}"
    if pass_to_pass < 1 and config.zero_if_pass_to_pass_breaks:
        return 0.0, False, f"partial credit 0 because PASS_TO_PASS broke: {summary}"
    return fail_to_pass, False, f"partial credit: {summary}"


def grading_script(task: Task) -> str:
    """The shell script that runs the task's tests, their output between the markers."""
    return "\n".join([*task.eval_commands, f"echo '{START_MARKER}'", task.test_cmd,
                      f"echo '{END_MARKER}'"])


def _undertow_statuses(task: Task, log: str) -> tuple[dict[str, str], bool]:
    """Undertow's parser on the log, read as the official harness reads one: only the part
    between the markers (all of it when that part names no test); no verdict without them."""
    if not holds_verdict(log):
        return {}, False
    parser = get_log_parser(task.log_parser)
    return parser(log.split(START_MARKER)[1].split(END_MARKER)[0]) or parser(log), True


def judge(task: Task, log: str, config: GradingConfig = GradingConfig(),
          timed_out: bool = False) -> Verdict:
    """The verdict of the task's parser (Undertow's, or the official harness's) on a log."""
    if task.log_parser.startswith(SWEBENCH_PARSER):
        decided_by = "swebench"
        statuses, found = official_statuses(
            log, instance_id=task.instance_id, repo=task.repo, version=task.version,
            log_parser=task.log_parser, fail_to_pass=task.FAIL_TO_PASS,
            pass_to_pass=task.PASS_TO_PASS)
    else:
        decided_by = "undertow"
        statuses, found = _undertow_statuses(task, log)
    fail_only = is_fail_only(task.repo, task.log_parser)
    outcomes = {test: classify_test(test, statuses, fail_only) for test in task.PASS_TO_PASS}
    outcomes.update({test: classify_test(test, statuses, fail_only,
                                         config.skipped_fail_to_pass_fails)
                     for test in task.FAIL_TO_PASS})
    successes = frozenset(t for t, outcome in outcomes.items() if outcome == "success")
    failures = frozenset(t for t, outcome in outcomes.items() if outcome == "failure")
    if not found:
        reason = (f"the tests ran past {task.timeout_s:g} s and were stopped"
                  if TIMEOUT_MARKER in log else "the log holds no test output, or says the "
                  "tests could not run")
        return Verdict(statuses, False, 0.0, False, f"no verdict: {reason}", decided_by,
                       successes, failures)
    reward, resolved, reason = score(task, statuses, config, timed_out)
    return Verdict(statuses, True, reward, resolved, reason, decided_by, successes, failures)


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
    if not task.log_parser.startswith(SWEBENCH_PARSER):
        get_log_parser(task.log_parser)  # an unknown parser fails before a container starts
    image = image or await ensure_task_image(connection, task)
    session = f"grade-{task.instance_id}"
    async with await Sandbox.start(connection, image, run=run, session=session,
                                   workdir=task.workdir, base_commit=task.base_commit,
                                   config=config.sandbox) as sandbox:
        await run_start_commands(sandbox, task)
        problem = await _apply(sandbox, diff, "session", config.apply_timeout_s)
        if problem is not None:
            log = f"{APPLY_FAILED_MARKER}\n{problem}\n"
            return Grade(0.0, False, reason=f"the diff does not apply: {problem}",
                         num_fail_to_pass=len(task.FAIL_TO_PASS),
                         duration_s=time.monotonic() - started,
                         log_path=_keep_log(config, task, diff, log))
        await _restore_tests(sandbox, task.test_patch, config.apply_timeout_s)
        problem = await _apply(sandbox, task.test_patch, "tests", config.apply_timeout_s)
        if problem is not None:
            raise SandboxError(f"task {task.instance_id}: its test_patch does not apply to the "
                               f"base commit: {problem}; fix the task")
        result = await sandbox.exec(grading_script(task), task.timeout_s)
    if not result.timed_out and START_MARKER not in result.output:
        # The script echoes the marker before the tests whatever the diff: without it, the
        # run never reached them or its output was lost, and neither is the diff's doing.
        raise SandboxError(
            f"task {task.instance_id}: the grading run ended (exit code {result.exit_code}) "
            f"without the start marker its script echoes before the tests, in "
            f"{len(result.output)} characters of output: no verdict on the diff; "
            f"output: {result.output.strip()[-500:] or '(none)'!r}")
    log = result.output + (f"\n{TIMEOUT_MARKER}\n" if result.timed_out else "")
    verdict = judge(task, log, config, timed_out)
    tests = {test: verdict.statuses.get(test, MISSING)
             for test in (*task.FAIL_TO_PASS, *task.PASS_TO_PASS)}
    return Grade(
        reward=verdict.reward, resolved=verdict.resolved, tests=tests,
        num_fail_to_pass_passed=sum(is_passing(tests[test]) for test in task.FAIL_TO_PASS),
        num_fail_to_pass=len(task.FAIL_TO_PASS),
        broken_pass_to_pass=tuple(t for t in task.PASS_TO_PASS if t in verdict.failures),
        reason=verdict.reason, log_tail=log[-_LOG_TAIL_CHARS:],
        duration_s=time.monotonic() - started, decided_by=verdict.decided_by,
        log_path=_keep_log(config, task, diff, log))


def _keep_log(config: GradingConfig, task: Task, diff: str, log: str) -> str:
    if config.log_dir is None:
        return ""
    path = Path(config.log_dir) / task.instance_id / f"{diff_key(diff)}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(log, encoding="utf-8")
    return str(path)
