"""An engine Undertow starts ends with the process that started it (`engines/lifetime.py`),
however that process ends; an engine the user started is never stopped by Undertow.

Real processes throughout: the supervisor on a small command (a shell that starts a child,
so that the whole process group is checked), the built-in engine started by `start_engine`
in a process killed with SIGKILL, and `undertow serve` killed the same way with the engine
it started and with one the user started."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.engines.conftest import start_builtin_engine
from tests.processes import REPO, alive, descendants
from undertow.gateway.engines.lifetime import POLL_S, WatchedProcess, main, supervised

DEADLINE_S = 120.0   # a failure's bound, not a figure: the watchdog acts within POLL_S


def _wait_gone(pids: set[int]) -> set[int]:
    """Those of `pids` still running after the deadline (empty once all have ended)."""
    deadline = time.monotonic() + DEADLINE_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def _kill_all(pids: set[int]) -> None:
    for pid in alive(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _starter(script: str, *args: str) -> subprocess.Popen:
    """A python process running `script`, in its own process group; its stdout piped."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


SUPERVISED_SHELL = """
    import subprocess
    from undertow.gateway.engines.lifetime import supervised
    server = subprocess.Popen(supervised(["sh", "-c", "sleep 600 & echo $!; wait"], grace_s=2),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    print(server.pid, server.stdout.readline().strip(), flush=True)
    import time; time.sleep(600)
"""


def _end(starter: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(starter.pid, signal.SIGKILL)   # its group; a started server has its own
    starter.wait()
    starter.stdout.close()


def test_the_server_and_its_children_end_when_the_starter_is_killed():
    starter = _starter(SUPERVISED_SHELL)
    started: set[int] = set()
    try:
        server_pid, child_pid = map(int, starter.stdout.readline().split())
        started = {server_pid, child_pid}
        assert alive(started) == started
        watchdog = descendants(server_pid) - {child_pid}
        assert len(watchdog) == 1   # the supervisor's watchdog, in the server's group
        _end(starter)
        assert _wait_gone(started | watchdog) == set()
    finally:
        _end(starter)
        _kill_all(started)


def test_the_server_keeps_its_pid_exit_status_and_outlives_the_thread_that_started_it():
    """The supervisor `exec`s the server (same PID, same exit status), and the starter's
    forking thread ending is not the starter ending (PR_SET_PDEATHSIG alone would kill it)."""
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(subprocess.Popen(
        supervised([sys.executable, "-c", "import os, sys, time; print(os.getpid(), "
                    "flush=True); sys.stdin.readline(); sys.exit(7)"]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)))
    thread.start()
    thread.join()
    (server,) = started
    try:
        assert int(server.stdout.readline()) == server.pid
        time.sleep(3 * POLL_S)   # the watchdog has looked several times
        assert server.poll() is None
        server.stdin.write("end\n")
        server.stdin.flush()
        assert server.wait(timeout=DEADLINE_S) == 7
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        server.stdin.close()
        server.stdout.close()
    # The watchdog, left alone in the group, ends with the server.
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and _group_members(server.pid):
        time.sleep(0.1)
    assert _group_members(server.pid) == set()


def _group_members(group: int) -> set[int]:
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == group and fields[0] != "Z":
                    members.add(int(entry.name))
    return members


def test_a_starter_already_gone_starts_nothing(capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert main(["--parent", str(gone.pid), "--", "sh", "-c", "exit 0"]) == 1
    assert "has already gone; not starting it" in capsys.readouterr().err


def test_a_reused_pid_is_not_taken_for_the_starter():
    me = WatchedProcess.of(os.getpid())
    assert me.alive()
    assert not WatchedProcess(os.getpid(), "1").alive()   # same PID, another start time


ENGINE_STARTER = """
    import asyncio, sys
    from pathlib import Path
    from undertow.gateway.engines.launch import BuiltinLauncher, start_engine

    async def serve():
        engine = await start_engine(BuiltinLauncher(overrides={"num_threads": 1}), sys.argv[1],
                                    log_path=Path(sys.argv[2]))
        print(engine.process.pid, engine.url, flush=True)
        await asyncio.sleep(600)

    asyncio.run(serve())
"""


@pytest.mark.slow
def test_a_started_engine_ends_when_its_starter_is_killed(tiny_model_dir, tmp_path):
    starter = _starter(ENGINE_STARTER, str(tiny_model_dir), str(tmp_path / "engine.log"))
    engine: set[int] = set()
    try:
        line = starter.stdout.readline()
        assert line, (tmp_path / "engine.log").read_text()[-2000:]
        engine_pid, url = int(line.split()[0]), line.split()[1]
        engine = {engine_pid} | descendants(engine_pid)
        with urllib.request.urlopen(url + "/health", timeout=30) as reply:
            assert reply.status == 200
        _end(starter)
        assert _wait_gone(engine) == set(), (tmp_path / "engine.log").read_text()[-2000:]
        assert "which started this engine, has gone" in (tmp_path / "engine.log").read_text()
    finally:
        _end(starter)
        _kill_all(engine)


def _serve(*args: str, log: Path) -> tuple[subprocess.Popen, list[str]]:
    """`undertow serve ARGS` in its own process group, until its banner is printed."""
    with open(log, "wb") as handle:
        process = subprocess.Popen([sys.executable, "-m", "undertow.cli", "serve", *args],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=handle, text=True,
                                   start_new_session=True)
    lines: list[str] = []
    while not any(line.startswith("admin ") for line in lines):
        line = process.stdout.readline()
        assert line, log.read_text()[-2000:]
        lines.append(line)
    return process, lines


@pytest.mark.slow
def test_undertow_serve_killed_takes_its_engine_but_never_a_given_one(tiny_model_dir,
                                                                      tmp_path):
    serve, _ = _serve("--model", str(tiny_model_dir), "--store", str(tmp_path / "a" / "store"),
                      log=tmp_path / "serve-a.log")
    engine = descendants(serve.pid)
    try:
        assert engine, "undertow serve started no engine process"
        _end(serve)
        assert _wait_gone(engine) == set()
    finally:
        _end(serve)
        _kill_all(engine)

    with start_builtin_engine(tiny_model_dir) as url:
        serve, lines = _serve("--model", str(tiny_model_dir), "--engine", url, "--store",
                              str(tmp_path / "b" / "store"), log=tmp_path / "serve-b.log")
        assert any(url in line and "(given)" in line for line in lines)
        _end(serve)
        time.sleep(3 * POLL_S)   # a watchdog, were there one, would have acted
        with urllib.request.urlopen(url + "/health", timeout=30) as reply:
            assert reply.status == 200


def test_the_supervisor_imports_nothing_heavy():
    """The supervisor module imports no event loop or third-party package (it runs before
    every engine, vLLM's python environment included)."""
    code = ("import sys; import undertow.gateway.engines.lifetime; "
            "print(sorted(m for m in ('asyncio', 'aiohttp', 'torch') if m in sys.modules))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout
    assert output.strip() == "[]"
