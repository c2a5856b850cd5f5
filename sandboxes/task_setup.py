"""A task's set-up commands, each run where the official harnesses run it; the squash of
the history and the base of a session's diff. Field by field, and why: docs/sandboxes.md#set-up.
"""

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from undertow.sandboxes.errors import SetupFailed
from undertow.sandboxes.sandbox import Sandbox
from undertow.sandboxes.task import Task

START_COMMAND_TIMEOUT_S = 600.0
_OUTPUT_TAIL_CHARS = 2000


@dataclass(frozen=True)
class SetupStep:
    """One start command as it ran: exit code (124 when it ran past its limit), seconds,
    and the tail of its merged output."""

    command: str
    exit_code: int
    duration_s: float
    output: str


def _log(log_path: Path | None, lines: list[str]) -> None:
    if log_path is None:
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as log:
        log.write("".join(line + "\n" for line in lines))


def _step_lines(step: SetupStep) -> list[str]:
    lines = [f"$ {step.command}",
             f"# exit code {step.exit_code}, {step.duration_s:.2f} s"]
    return lines + [f"  {line}" for line in step.output.splitlines()]


def describe(task: Task, image: str) -> list[str]:
    """The sandbox log's header: the image and where each set-up field ran
    (docs/sandboxes.md#set-up)."""
    lines = [f"# task {task.instance_id}, image {image}"]
    if task.environment_setup_commit:
        lines.append(f"# environment_setup_commit {task.environment_setup_commit}: the "
                     "environment the image was built with (not checked out in a container)")
    if task.pre_install:
        where = ("ran when Undertow built the image" if task.image is None
                 else "already part of the published image; not run again")
        count = f"{len(task.pre_install)} command{'s' if len(task.pre_install) > 1 else ''}"
        lines.append(f"# pre_install ({count}): {where}")
    if not task.start_commands:
        lines.append("# no start commands")
    return lines


async def run_start_commands(sandbox: Sandbox, task: Task, *, log_path: Path | None = None,
                             timeout_s: float = START_COMMAND_TIMEOUT_S) -> list[SetupStep]:
    """Runs the task's start commands in order, as the image's user, in its workdir; each
    is logged to `log_path`. Raises SetupFailed naming the task and the command at the
    first that fails."""
    steps = []
    for command in task.start_commands:
        result = await sandbox.exec(command, timeout_s)
        step = SetupStep(command, result.exit_code, result.duration_s,
                         result.output[-_OUTPUT_TAIL_CHARS:])
        steps.append(step)
        _log(log_path, _step_lines(step))
        if result.exit_code != 0:
            why = (f"ran past {timeout_s:g} s" if result.timed_out
                   else f"exited with code {result.exit_code}")
            raise SetupFailed(
                f"task {task.instance_id}: start command {command!r} {why} in sandbox "
                f"{sandbox.container.short_id}: {step.output.strip()[-500:] or '(no output)'}; "
                "the task cannot run in its image: check the task's start_commands and image")
    return steps


async def use_head_as_diff_base(sandbox: Sandbox, log_path: Path | None = None) -> str:
    """Makes the commit the sandbox's work starts from (HEAD) its diff base; returns it.
    A workdir without a git history keeps the base it had."""
    result = await sandbox.exec(
        f"git -C {shlex.quote(sandbox.workdir)} rev-parse --verify -q HEAD", timeout_s=60)
    head = result.output.strip()
    if result.exit_code == 0 and head:
        if head != sandbox.base_commit:
            _log(log_path, [f"# diff base: HEAD {head} (the task's base commit is "
                            f"{sandbox.base_commit or 'not set'})"])
        sandbox.base_commit = head
    return sandbox.base_commit


# Deterministic identity and dates: the same start state gives the same squashed commit.
_SQUASH_ENV = ("GIT_AUTHOR_NAME=undertow GIT_AUTHOR_EMAIL=undertow@localhost "
               "GIT_COMMITTER_NAME=undertow GIT_COMMITTER_EMAIL=undertow@localhost "
               "GIT_AUTHOR_DATE=2000-01-01T00:00:00Z GIT_COMMITTER_DATE=2000-01-01T00:00:00Z")
_SQUASH_SCRIPT = """set -e
git rev-parse --verify -q HEAD >/dev/null || { echo "no history"; exit 0; }
commits=$(git rev-list --all --count)
if [ "$commits" = 1 ] && [ -z "$(git remote)" ]; then echo "one commit"; exit 0; fi
branch=$(git symbolic-ref -q --short HEAD || echo task)
start=$(env %(env)s git commit-tree -m "task start" "HEAD^{tree}")
for remote in $(git remote); do git remote remove "$remote"; done
git for-each-ref --format='delete %%(refname)' | git update-ref --stdin
git update-ref "refs/heads/$branch" "$start"
git symbolic-ref HEAD "refs/heads/$branch"
rm -f .git/ORIG_HEAD .git/FETCH_HEAD .git/MERGE_HEAD .git/CHERRY_PICK_HEAD
git reflog expire --expire=now --all
git gc -q --prune=now
echo "squashed $commits commits into one"
"""


async def squash_history(sandbox: Sandbox, task: Task, log_path: Path | None = None,
                         timeout_s: float = START_COMMAND_TIMEOUT_S) -> str:
    """Leaves HEAD's tree as the repository's only commit, so that no history can show the
    fix: every other ref, remote and reflog is removed and unreachable objects are pruned
    (a repository with one commit and no remote is left as it is). Returns what was done;
    raises SetupFailed naming the task when git fails."""
    script = f"cd {shlex.quote(sandbox.workdir)}\n" + _SQUASH_SCRIPT % {"env": _SQUASH_ENV}
    result = await sandbox.exec(script, timeout_s)
    if result.exit_code != 0:
        raise SetupFailed(f"task {task.instance_id}: squashing the git history failed "
                          f"({result.exit_code}): {result.output.strip()[-500:]}; set "
                          "sandbox git_history: keep to leave the image's history")
    outcome = result.output.strip().splitlines()[-1] if result.output.strip() else ""
    _log(log_path, [f"# git history: {outcome} ({result.duration_s:.2f} s)"])
    return outcome


async def prepare_session_sandbox(sandbox: Sandbox, task: Task, image: str,
                                  log_path: Path | None = None) -> list[SetupStep]:
    """Everything a session's sandbox needs before its scaffold starts: the start commands,
    the history squashed (unless the sandbox keeps it), then HEAD as its diff base; the
    sandbox log records each."""
    started = time.monotonic()
    _log(log_path, describe(task, image))
    steps = await run_start_commands(sandbox, task, log_path=log_path)
    if sandbox.config.git_history == "squash":
        await squash_history(sandbox, task, log_path)
    await use_head_as_diff_base(sandbox, log_path)
    _log(log_path, [f"# set-up done in {time.monotonic() - started:.2f} s"])
    return steps
