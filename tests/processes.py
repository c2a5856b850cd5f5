"""Processes of tests: an `undertow` command run as a child (`run_undertow`, `run_train`), and
what Ray (or any server a test starts) left running below a test's own."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc), zombies left out."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (not zombies)."""
    living = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            living.add(pid)
    return living


def run_undertow(arguments: list[str], log: Path, timeout_s: float) -> int:
    """`undertow ARGUMENTS...` in its own process group, from the repository (on its
    PYTHONPATH, for the tests' rollout sources), its output appended to `log`; its exit
    status, or the test fails with the log's end after `timeout_s`."""
    command = [sys.executable, "-m", "undertow.cli", *arguments]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    with open(log, "ab") as handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True, env={**os.environ, "PYTHONPATH": path})
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"undertow {arguments[0]} did not finish; its log:\n"
                    f"{log.read_text()[-3000:]}")


def run_train(run_dir: Path, overrides: list[str], log: Path, timeout_s: float) -> int:
    """`undertow train --run-dir RUN_DIR OVERRIDES...` (`run_undertow`)."""
    return run_undertow(["train", "--run-dir", str(run_dir), *overrides], log, timeout_s)
