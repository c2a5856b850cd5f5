"""Host scaffold processes: exit, crash, hang (time limit), flood (output limit), kill."""

import asyncio
import os
import sys
from pathlib import Path

from undertow.adapters.base import CRASHED, EXITED, KILLED, OUTPUT_FLOOD, TIMEOUT
from undertow.adapters.process import HostProcess


async def start(tmp_path, script: str, **limits) -> HostProcess:
    return await HostProcess.start(["bash", "-c", script], env=dict(os.environ), cwd=tmp_path,
                                   log_path=tmp_path / "log", **limits)


async def test_exit_code_and_log(tmp_path):
    process = await start(tmp_path, "echo hello; echo oops >&2; exit 0")
    exit = await process.wait(30)
    assert (exit.cause, exit.exit_code) == (EXITED, 0)
    assert "hello" in exit.log_tail and "oops" in (tmp_path / "log").read_text()


async def test_crash_is_recorded(tmp_path):
    exit = await (await start(tmp_path, "echo dying; exit 3")).wait(30)
    assert (exit.cause, exit.exit_code) == (CRASHED, 3)


async def test_hang_is_killed_with_its_children_at_the_limit(tmp_path):
    pid_file = tmp_path / "child.pid"
    process = await start(tmp_path, f"trap '' TERM; sleep 600 & echo $! > {pid_file}; wait")
    for _ in range(600):  # until the child is running (the machine may be busy)
        if pid_file.exists() and pid_file.read_text().strip():
            break
        await asyncio.sleep(0.05)
    exit = await process.wait(0.5)
    assert exit.cause == TIMEOUT and exit.exit_code is None
    child = int(pid_file.read_text())
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or ") Z " in stat.read_text()  # gone, or a zombie


async def test_flood_is_killed_and_the_log_stays_bounded(tmp_path):
    process = await start(tmp_path, "yes flood", max_output_bytes=4 * 2**20,
                          max_log_bytes=64 * 2**10)
    exit = await process.wait(60)
    assert exit.cause == OUTPUT_FLOOD
    assert exit.num_output_bytes > 4 * 2**20
    assert (tmp_path / "log").stat().st_size < 80 * 2**10


async def test_kill_ends_a_running_process(tmp_path):
    process = await HostProcess.start([sys.executable, "-c", "import time; time.sleep(600)"],
                                      env=dict(os.environ), cwd=tmp_path,
                                      log_path=tmp_path / "log")
    await process.kill()
    exit = await process.wait(1)
    assert exit.cause == KILLED
