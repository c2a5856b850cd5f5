"""Fixtures for the sandbox tests: one Docker connection, one run label, shared images.

Every container a test starts carries this test session's run label. The
`docker_run` fixture removes them all at the end and fails the session if any was
still there: a test that forgets to close its sandbox (or closes it only on the
happy path) shows up as an error instead of a leak.

The tests' own tiny task set: the repository `minimath` ships in its fixed state;
the task's base state has two bugs in two files (`clamp` in ops.py, `mean` in
stats.py). The gold patch fixes both; `half_fix.diff` fixes only `clamp`. The
held-back tests add `tests/test_fixes.py` (the two FAIL_TO_PASS tests) and one
more test to the visible `tests/test_ops.py`.
"""

import asyncio
import io
import ipaddress
import json
import subprocess
import uuid
from pathlib import Path

import pytest

from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import compute_base_commit

FIXED = {
    "minimath/__init__.py": (
        "from minimath.ops import add, clamp\nfrom minimath.stats import mean\n"),
    "minimath/ops.py": (
        "def add(a, b):\n    return a + b\n\n\n"
        "def clamp(value, low, high):\n    return max(low, min(value, high))\n"),
    "minimath/stats.py": (
        "def mean(values):\n    values = list(values)\n    return sum(values) / len(values)\n"),
    "tests/test_ops.py": (
        "from minimath import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"),
}
BUGGY = {
    "minimath/ops.py": FIXED["minimath/ops.py"].replace(
        "max(low, min(value, high))", "min(low, max(value, high))"),
    "minimath/stats.py": FIXED["minimath/stats.py"].replace(
        "/ len(values)", "/ (len(values) + 1)"),
}
HELD_BACK_TESTS = {
    "tests/test_fixes.py": (
        "from minimath import clamp, mean\n\n\n"
        "def test_clamp():\n    assert clamp(5, 0, 3) == 3\n    assert clamp(-1, 0, 3) == 0\n\n\n"
        "def test_mean():\n    assert mean([1, 2, 3]) == 2\n"),
    "tests/test_ops.py": FIXED["tests/test_ops.py"] + (
        "\n\ndef test_add_negative():\n    assert add(-2, -3) == -5\n"),
}
FAIL_TO_PASS = ["tests/test_fixes.py::test_clamp", "tests/test_fixes.py::test_mean"]
PASS_TO_PASS = ["tests/test_ops.py::test_add", "tests/test_ops.py::test_add_negative"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def git_diff(before: dict[str, str], after: dict[str, str], scratch: Path) -> str:
    """The git diff that turns files `before` into files `after`."""
    scratch.mkdir(parents=True)
    _write(scratch, before)
    run = {"cwd": scratch, "check": True, "capture_output": True, "text": True}
    subprocess.run(["git", "init", "-q"], **run)
    subprocess.run(["git", "add", "-A"], **run)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a"],
                   **run)
    _write(scratch, after)
    subprocess.run(["git", "add", "-A"], **run)
    return subprocess.run(["git", "diff", "--cached"], **run).stdout


def write_task_set(root: Path) -> Path:
    """Writes the task set (tasks.jsonl + repos/minimath) under `root`; returns `root`."""
    _write(root / "repos" / "minimath", FIXED)
    patch = git_diff(BUGGY, {name: FIXED[name] for name in BUGGY}, root / "scratch-patch")
    half = git_diff(BUGGY, {"minimath/ops.py": FIXED["minimath/ops.py"]}, root / "scratch-half")
    (root / "half_fix.diff").write_text(half)
    test_patch = git_diff(FIXED, {**FIXED, **HELD_BACK_TESTS}, root / "scratch-tests")
    record = {
        "instance_id": "minimath-1", "repo": "undertow/minimath", "base_commit": "",
        "problem_statement": "clamp() returns the wrong bound and mean() is off.",
        "patch": patch, "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(FAIL_TO_PASS), "PASS_TO_PASS": PASS_TO_PASS,
        "image": None, "test_cmd": "python -m pytest -rA -p no:cacheprovider",
        "log_parser": "pytest", "timeout_s": 120,
    }
    (root / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    record["base_commit"] = compute_base_commit(load_tasks(root)[0])
    (root / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    return root


@pytest.fixture(scope="session")
def docker_connection():
    from undertow.sandboxes.connection import connect

    connection = connect()
    yield connection
    connection.close()


@pytest.fixture(scope="session")
def docker_run(docker_connection):
    """The run label of this test session; no container of it may outlive the session."""
    from undertow.sandboxes.sandbox import RUN_LABEL, SANDBOX_LABEL, gc

    run = f"pytest-{uuid.uuid4().hex[:12]}"
    yield run
    # Tests may label containers with runs derived from this one ("<run>-crashed").
    containers = docker_connection.client.containers.list(
        all=True, filters={"label": SANDBOX_LABEL})
    runs = {c.labels.get(RUN_LABEL, "") for c in containers}
    num_left = sum(asyncio.run(gc(docker_connection, r)) for r in runs if r.startswith(run))
    assert num_left == 0, f"{num_left} sandbox container(s) of {run} were left behind"


@pytest.fixture(scope="session")
def host_bridge_ip(docker_connection) -> str:
    """The host's address on Docker's default bridge (what a bridged container reaches)."""
    config = docker_connection.client.networks.get("bridge").attrs["IPAM"]["Config"][0]
    if config.get("Gateway"):
        return config["Gateway"]
    return str(next(ipaddress.ip_network(config["Subnet"]).hosts()))


@pytest.fixture(scope="session")
def base_image(docker_connection) -> str:
    """The base image, built once (or reused) for the whole test session."""
    from undertow.sandboxes.base_image import build_base_image

    return asyncio.run(build_base_image(docker_connection)).tag


@pytest.fixture(scope="session")
def task_set_dir(tmp_path_factory) -> Path:
    return write_task_set(tmp_path_factory.mktemp("taskset"))


@pytest.fixture(scope="session")
def fixture_task(task_set_dir):
    return load_tasks(task_set_dir)[0]


@pytest.fixture(scope="session")
def fixture_image(docker_connection, base_image, fixture_task) -> str:
    from undertow.sandboxes.task_image import ensure_task_image

    return asyncio.run(ensure_task_image(docker_connection, fixture_task))


def build_volume_image(client, base: str) -> str:
    """An image of `base` that declares an anonymous volume (`VOLUME /scratch`), as published
    images may: each container of it gets a volume of its own. Built offline."""
    tag = f"undertow-test/volume-{base.rsplit(':', 1)[-1]}"
    client.images.build(fileobj=io.BytesIO(f"FROM {base}\nVOLUME /scratch\n".encode()),
                        tag=tag, network_mode="none", rm=True)
    return tag


@pytest.fixture(scope="session")
def volume_image(docker_connection, fixture_image) -> str:
    return build_volume_image(docker_connection.client, fixture_image)
