"""Host scaffold processes: exit, crash, hang (time limit), flood (output limit), kill."""

import asyncio
import os
import sys
from pathlib import Path

import pytest

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


async def test_long_output_keeps_a_bounded_log_and_counts_every_byte(tmp_path):
    """A program that prints 8 MiB, more than its output limit but spread over many
    flood windows (each window here holds one read), as a session of hours would: it
    is not a flood, the log keeps its first and last lines within the log bound, and
    every byte is counted."""
    script = "for i in $(seq 1 1000000); do echo \"line $i\"; done | head -c 8388608"
    process = await start(tmp_path, script, max_output_bytes=2**20, max_log_bytes=32 * 2**10,
                          flood_window_s=1e-9)
    exit = await process.wait(300)
    assert (exit.cause, exit.exit_code) == (EXITED, 0)
    assert exit.num_output_bytes == 8 * 2**20
    assert len(process.output.head) + len(process.output.tail) <= 32 * 2**10
    log = (tmp_path / "log").read_text()
    assert log.startswith("line 1\nline 2\n") and "bytes of output truncated" in log
    assert len(log.encode()) < 33 * 2**10
    tail_lines = log.split("truncated ...]\n", 1)[1].split("\n")[1:-1]   # whole lines only
    numbers = [int(line.split()[1]) for line in tail_lines]
    assert len(numbers) > 1000 and numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert numbers[-1] > 500_000   # the tail is the end of the output, not its middle


async def test_a_flood_window_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="flood_window_s"):
        await start(tmp_path, "true", flood_window_s=0)


async def test_kill_ends_a_running_process(tmp_path):
    process = await HostProcess.start([sys.executable, "-c", "import time; time.sleep(600)"],
                                      env=dict(os.environ), cwd=tmp_path,
                                      log_path=tmp_path / "log")
    await process.kill()
    exit = await process.wait(1)
    assert exit.cause == KILLED
