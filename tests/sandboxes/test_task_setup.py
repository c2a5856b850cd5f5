"""Where a task's set-up runs: SWE-smith's instance branch at container start, pre_install at
image build, environment_setup_commit recorded (`sandboxes/task_setup.py`).

The SWE-smith fixture is a repository in the shape of SWE-smith's images: `main` holds the
fixed code, and the branch named after the instance holds one commit ("Bug Patch") that
breaks `clamp`; the image (built here from the base image, offline) is at `main`. Its row,
in SWE-smith's shape (`patch` makes the bug), goes through `undertow tasks import
swe-smith`; the import's image name (with `--registry`) is given to the image built here.
"""

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path

import docker.errors
import pytest

from tests.sandboxes.swe_smith_images import (
    add_instance_branch,
    build_repository_image,
    git,
    init_main,
)
from undertow.cli import main
from undertow.sandboxes.base_image import AGENT_UID
from undertow.sandboxes.datasets.formats import swe_smith_start_commands
from undertow.sandboxes.errors import ImageError, SetupFailed
from undertow.sandboxes.grading import grade
from undertow.sandboxes.sandbox import Sandbox, SandboxConfig
from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import (
    PRE_INSTALL_LABEL,
    compute_base_commit,
    ensure_task_image,
)
from undertow.sandboxes.task_setup import prepare_session_sandbox

INSTANCE = "undertow__minimath.0123abcd.func_pm_flip__clamp"
REGISTRY = "undertow-test"
FIXED_OPS = ("def add(a, b):\n    return a + b\n\n\n"
             "def clamp(value, low, high):\n    return max(low, min(value, high))\n")
BUGGY_OPS = FIXED_OPS.replace("max(low, min(value, high))", "min(low, max(value, high))")
TESTS = ("from minimath.ops import add, clamp\n\n\n"
         "def test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_clamp():\n    assert clamp(5, 0, 3) == 3\n")

pytestmark = pytest.mark.docker


def _swe_smith_repo(root: Path) -> tuple[Path, str]:
    """The repository as SWE-smith's image holds it, and the bug patch its row carries."""
    repo = root / "testbed"
    (repo / "minimath").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "minimath" / "__init__.py").write_text("")
    (repo / "conftest.py").write_text("")  # `pytest` (not `python -m`) then finds minimath
    (repo / "minimath" / "ops.py").write_text(FIXED_OPS)
    (repo / "tests" / "test_ops.py").write_text(TESTS)
    init_main(repo)
    bug_patch = add_instance_branch(
        repo, INSTANCE, lambda repo: (repo / "minimath" / "ops.py").write_text(BUGGY_OPS))
    return repo, bug_patch


@pytest.fixture(scope="module")
def smith_task(docker_connection, base_image, tmp_path_factory):
    """The imported SWE-smith task, its image built here; removed after the module."""
    root = tmp_path_factory.mktemp("swe-smith")
    repo, bug_patch = _swe_smith_repo(root)
    row = {"instance_id": INSTANCE, "repo": "swesmith/undertow__minimath.0123abcd",
           "patch": bug_patch, "problem_statement": "clamp returns the wrong bound",
           "FAIL_TO_PASS": ["tests/test_ops.py::test_clamp"],
           "PASS_TO_PASS": ["tests/test_ops.py::test_add"], "created_at": "2025-01-01",
           "image_name": "jyangballin/swesmith.x86_64.undertow_1776_minimath.0123abcd"}
    (root / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["tasks", "import", "swe-smith", "--from", str(root / "rows.jsonl"),
                 "--out", str(root / "set"), "--registry", REGISTRY]) == 0
    [task] = load_tasks(root / "set")
    client = docker_connection.client
    build_repository_image(client, base_image, repo, task.image)
    yield task, repo
    client.images.remove(task.image, force=True)


async def test_swe_smith_sandbox_starts_at_the_instance_branch(docker_connection, docker_run,
                                                               smith_task, tmp_path):
    task, repo = smith_task
    assert task.image == f"{REGISTRY}/jyangballin/swesmith.x86_64.undertow_1776_minimath.0123abcd"
    assert task.start_commands[-1] == f"git checkout -q {INSTANCE}"
    log = tmp_path / "sandbox.log"
    async with await Sandbox.start(docker_connection, task.image, run=docker_run,
                                   session="smith", base_commit=task.base_commit) as sandbox:
        assert (await sandbox.read_file("minimath/ops.py")).decode() == FIXED_OPS  # main
        await prepare_session_sandbox(sandbox, task, task.image, log)
        assert (await sandbox.read_file("minimath/ops.py")).decode() == BUGGY_OPS
        # The fix on `main` is gone from the history: one commit with the bug's tree, and
        # neither the fixed commit nor the fixed file's blob is left in the object store.
        commits = await sandbox.exec("git log --all --format='%H %T'", 30)
        [(head, tree)] = [line.split() for line in commits.output.split("\n") if line]
        assert tree == git(repo, "rev-parse", f"{INSTANCE}^{{tree}}").strip()
        assert sandbox.base_commit == head
        for hidden in (git(repo, "rev-parse", "main").strip(),
                       git(repo, "rev-parse", "main:minimath/ops.py").strip()):
            assert (await sandbox.exec(f"git cat-file -e {hidden}", 30)).exit_code != 0
        assert (await sandbox.exec("git remote; git stash list; git reflog", 30)).output == ""
        assert await sandbox.diff() == ""  # the checkout is not the agent's work
        await sandbox.write_file("/tmp/fix.diff", task.patch)
        result = await sandbox.exec("git apply /tmp/fix.diff", 30)
        assert result.exit_code == 0, result.output
        diff = await sandbox.diff()
    text = log.read_text()
    assert f"$ git checkout -q {INSTANCE}\n# exit code 0" in text
    assert "# git history: squashed 2 commits into one" in text
    assert f"# diff base: HEAD {head}" in text
    assert "clamp" in diff and diff.count("diff --git") == 1

    fixed, unfixed = await asyncio.gather(
        grade(docker_connection, task, diff, run=docker_run),
        grade(docker_connection, task, "", run=docker_run))
    assert (fixed.reward, fixed.resolved) == (1.0, True), fixed.reason + fixed.log_tail
    assert unfixed.reward == 0.0 and unfixed.tests == {
        "tests/test_ops.py::test_clamp": "failed", "tests/test_ops.py::test_add": "passed"}


async def test_a_sandbox_that_keeps_the_history_starts_at_the_bug_commit(
        docker_connection, docker_run, smith_task, tmp_path):
    task, repo = smith_task
    keep = SandboxConfig(git_history="keep")
    async with await Sandbox.start(docker_connection, task.image, run=docker_run,
                                   session="smith-keep", config=keep) as sandbox:
        await prepare_session_sandbox(sandbox, task, task.image, tmp_path / "sandbox.log")
        assert sandbox.base_commit == git(repo, "rev-parse", INSTANCE).strip()
        fixed = await sandbox.exec("git show main:minimath/ops.py", 30)
    assert fixed.output == FIXED_OPS  # what "squash" exists to hide
    assert "git history" not in (tmp_path / "sandbox.log").read_text()
    with pytest.raises(ValueError, match="git_history must be 'squash' or 'keep'"):
        SandboxConfig(git_history="hide")


async def test_a_failing_start_command_is_an_infrastructure_failure(docker_connection,
                                                                    docker_run, smith_task,
                                                                    tmp_path):
    """An instance whose branch the image lacks: the fetch SWE-smith's harness runs first
    fails (no remote, no network), and the error names the task and that command."""
    task, _ = smith_task
    missing = f"{INSTANCE}.missing"
    broken = dataclasses.replace(task, start_commands=tuple(swe_smith_start_commands(missing)),
                                 pre_install=("apt-get update",))
    log = tmp_path / "sandbox.log"
    async with await Sandbox.start(docker_connection, task.image, run=docker_run,
                                   session="smith-broken") as sandbox:
        with pytest.raises(SetupFailed) as failed:
            await prepare_session_sandbox(sandbox, broken, task.image, log)
    assert (f"task {INSTANCE}: start command 'git show-ref -q {missing} || git fetch -q origin "
            f"{missing}' exited with code 128") in str(failed.value)
    assert f"$ git show-ref -q {missing}" in log.read_text()
    assert "pre_install (1 command): already part of the published image" in log.read_text()
    assert f"git checkout -q {missing}" not in log.read_text()  # nothing after the failure
    with pytest.raises(SetupFailed, match="git fetch -q origin"):
        await grade(docker_connection, broken, task.patch, run=docker_run)


@pytest.fixture
def own_tag(docker_connection):
    """Task images this test builds, removed after it."""
    tags: list[str] = []
    yield tags
    for tag in tags:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_connection.client.images.remove(tag, force=True)


async def test_pre_install_runs_as_root_when_the_image_is_built(docker_connection, docker_run,
                                                               fixture_task, base_image,
                                                               own_tag, tmp_path):
    task = dataclasses.replace(
        fixture_task, instance_id="minimath-pre-install", environment_setup_commit="e" * 40,
        pre_install=("id -u > /etc/pre-install-user",
                     "echo '# set up' >> minimath/__init__.py"))
    task = dataclasses.replace(task, base_commit=compute_base_commit(task))  # its own message
    image = await ensure_task_image(docker_connection, task)
    own_tag.append(image)
    labels = docker_connection.client.images.get(image).labels
    assert labels["undertow.environment_setup_commit"] == "e" * 40
    assert labels[PRE_INSTALL_LABEL]
    log = tmp_path / "sandbox.log"
    async with await Sandbox.start(docker_connection, image, run=docker_run, session="pre",
                                   base_commit=task.base_commit) as sandbox:
        probe = await sandbox.exec(  # the image as built: pre_install committed on the base
            "cat /etc/pre-install-user; id -u; git status --porcelain; git rev-parse HEAD~1; "
            "grep -c 'set up' minimath/__init__.py", 30)
        assert probe.output.split() == ["0", str(AGENT_UID), task.base_commit, "1"]
        await prepare_session_sandbox(sandbox, task, image, log)
        assert sandbox.base_commit != task.base_commit  # the squashed start state
        assert (await sandbox.exec("git rev-list --all --count", 30)).output.strip() == "1"
        assert await sandbox.diff() == ""
    text = log.read_text()
    assert "pre_install (2 commands): ran when Undertow built the image" in text
    assert f"environment_setup_commit {'e' * 40}" in text
    gold = await grade(docker_connection, task, task.patch, run=docker_run, image=image)
    assert gold.resolved, gold.reason


async def test_a_failing_pre_install_names_the_command(docker_connection, fixture_task,
                                                       base_image, own_tag):
    task = dataclasses.replace(fixture_task, instance_id="minimath-pre-install-fails",
                               pre_install=("true", "test -f requirements-dev.txt", "true"))
    task = dataclasses.replace(task, base_commit=compute_base_commit(task))
    own_tag.append(f"undertow/task-minimath-pre-install-fails:{task.base_commit[:12]}")
    with pytest.raises(ImageError) as failed:
        await ensure_task_image(docker_connection, task)
    assert ("task minimath-pre-install-fails: pre_install command 'test -f "
            "requirements-dev.txt' failed while its image was built") in str(failed.value)
