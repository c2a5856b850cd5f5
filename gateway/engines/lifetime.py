"""An engine Undertow starts dies with the process that started it.

Engines run in their own session (so that stopping one stops its children, and a Ctrl-C at
the terminal reaches Undertow first), which also means that nothing ends them when
`undertow train`, `serve` or `rollout` is killed hard (`kill -9` of the process group): the
engine, and on a GPU node its memory, would stay until someone kills it by hand. A
parent-death signal (`prctl(PR_SET_PDEATHSIG)`) is not enough: it fires when the *thread*
that forked exits, and the engines are started from the rollout loop's thread.

So every engine server is started through this module's supervisor
(`supervised(command)` in `launch.py`'s process start):

    python -m undertow.gateway.engines.lifetime --parent PID -- SERVER COMMAND...

It forks a watchdog, then `exec`s the server in its own place, so the server keeps the PID,
the process group and the exit status that the launcher sees (SGLang and vLLM, third-party
servers, are run unchanged). The watchdog, a small process in the server's group, checks
every `POLL_S` that the process that started the engine (`--parent`: its PID and start time,
so that a reused PID is not taken for it) still lives. When it has gone, the watchdog sends
SIGTERM to the server's process group, SIGKILL after `--grace-s`, and ends with it. When the
server exits on its own, the watchdog ends too.

An engine the user started (`run.engine_urls`, `--engine URL`) is never started here, so
nothing of Undertow ever stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["POLL_S", "WatchedProcess", "main", "supervised"]

POLL_S = 0.5
GRACE_S = 10.0
MODULE = "undertow.gateway.engines.lifetime"


def supervised(command: Sequence[str], grace_s: float = GRACE_S) -> list[str]:
    """`command` run under the supervisor, bound to the life of this process."""
    return [sys.executable, "-m", MODULE, "--parent", str(os.getpid()),
            "--grace-s", str(grace_s), "--", *command]


@dataclass(frozen=True)
class WatchedProcess:
    """A process known by its PID and its start time (Linux `/proc/PID/stat`, field 22;
    None elsewhere), so that a later process given the same PID is not taken for it."""

    pid: int
    start_time: str | None

    @classmethod
    def of(cls, pid: int) -> WatchedProcess:
        return cls(pid, _start_time(pid))

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass   # it exists, owned by another user
        return self.start_time is None or _start_time(self.pid) == self.start_time


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":   # a zombie has exited: only its parent has not read its status
        return "exited"
    return fields[19]


def watch(parent: WatchedProcess, server_pid: int, grace_s: float) -> None:
    """The watchdog's loop: returns when the server (this process's parent) has exited;
    ends the server's process group, and itself with it, once `parent` has gone."""
    while os.getppid() == server_pid:
        if not parent.alive():
            _end_group(parent, server_pid, grace_s)
            return
        time.sleep(POLL_S)


def _end_group(parent: WatchedProcess, server_pid: int, grace_s: float) -> None:
    group = os.getpgrp()
    print(f"undertow: process {parent.pid}, which started this engine, has gone; stopping "
          "the engine", file=sys.stderr, flush=True)
    os.killpg(group, signal.SIGTERM)   # the watchdog ignores it
    deadline = time.monotonic() + grace_s
    while os.getppid() == server_pid and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(group, signal.SIGKILL)   # the server's children, and this watchdog


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(
        "run an engine server that ends when the process --parent ends"))
    parser.add_argument("--parent", type=int, required=True, metavar="PID")
    parser.add_argument("--grace-s", type=float, default=GRACE_S)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the server's command after --")
    parent = WatchedProcess.of(args.parent)
    if not parent.alive():
        print(f"undertow: process {args.parent}, which starts this engine, has already gone; "
              "not starting it", file=sys.stderr)
        return 1
    server_pid = os.getpid()
    sys.stdout.flush()
    if os.fork() == 0:   # the watchdog
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            watch(parent, server_pid, args.grace_s)
        finally:
            os._exit(0)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        print(f"undertow: cannot run the engine command {command[0]!r}: {error}",
              file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
