"""Scaffold processes: on the host (`HostProcess`, a process group) or inside the sandbox
(`SandboxProcess`, one `exec`), with bounded output (docs/adapters.md#processes).
"""

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from undertow.adapters.base import CRASHED, EXITED, KILLED, OUTPUT_FLOOD, TIMEOUT, ScaffoldExit
from undertow.adapters.errors import ScaffoldLaunchError
from undertow.sandboxes.output import BoundedOutput
from undertow.sandboxes.sandbox import Sandbox

KILL_GRACE_S = 5.0
NUM_TAIL_CHARS = 4000
_CHUNK_BYTES = 65536
# Kills every process of the sandbox user but its init (PID 1), its keep-alive
# `sleep infinity`, and this script and its wrapper; bash builtins only.
_STOP_ALL = r"""
for entry in /proc/[0-9]*; do
  pid=${entry#/proc/}
  case " 1 $$ $PPID " in *" $pid "*) continue ;; esac
  { IFS= read -r -d '' first; IFS= read -r -d '' second; } < "$entry/cmdline" 2>/dev/null
  [ "$first" = sleep ] && [ "$second" = infinity ] && continue
  kill -9 "$pid" 2>/dev/null
done
exit 0
"""


class HostProcess:
    """A scaffold running on the host. Create with `await HostProcess.start(...)`.

    A program that prints more than `max_output_bytes` within one `flood_window_s` is killed
    (cause OUTPUT_FLOOD): a rate, not a total, so that a session that runs for hours and
    prints steadily is no flood. Killing sends SIGTERM to the group, then SIGKILL."""

    def __init__(self, process: asyncio.subprocess.Process, log_path: Path,
                 max_output_bytes: int, max_log_bytes: int, flood_window_s: float = 60.0):
        self.process = process
        self.log_path = log_path
        self.max_output_bytes = max_output_bytes
        self.flood_window_s = flood_window_s
        self.output = BoundedOutput(max_log_bytes)
        self.cause: str | None = None
        self.started_s = time.monotonic()
        self._reading = asyncio.ensure_future(self._read())
        self._exit: ScaffoldExit | None = None

    @classmethod
    async def start(cls, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path,
                    log_path: Path, max_output_bytes: int = 64 * 2**20,
                    max_log_bytes: int = 1 * 2**20, flood_window_s: float = 60.0
                    ) -> "HostProcess":
        if flood_window_s <= 0:
            raise ValueError(f"flood_window_s must be positive, got {flood_window_s}")
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=dict(env), cwd=str(cwd),
                start_new_session=True)
        except OSError as error:
            raise ScaffoldLaunchError(f"cannot start {argv[0]!r}: {error}; is it installed "
                                      "and on PATH?") from None
        return cls(process, log_path, max_output_bytes, max_log_bytes, flood_window_s)

    @property
    def num_output_bytes(self) -> int:
        return self.output.num_bytes

    async def _read(self) -> None:
        window_start_s, num_window_bytes = time.monotonic(), 0
        assert self.process.stdout is not None, "started with stdout=PIPE"
        while chunk := await self.process.stdout.read(_CHUNK_BYTES):
            self.output.add(chunk)
            now_s = time.monotonic()
            if now_s - window_start_s > self.flood_window_s:
                window_start_s, num_window_bytes = now_s, 0
            num_window_bytes += len(chunk)
            if num_window_bytes > self.max_output_bytes and self.cause is None:
                self.cause = OUTPUT_FLOOD
                self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    async def _stop(self, cause: str) -> None:
        if self.process.returncode is None and self.cause is None:
            self.cause = cause
        self._signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), KILL_GRACE_S)
        self._signal(signal.SIGKILL)  # the group's stragglers, if any
        await self.process.wait()

    async def wait(self, timeout_s: float) -> ScaffoldExit:
        if self._exit is not None:
            return self._exit
        try:
            await asyncio.wait_for(asyncio.shield(self.process.wait()), timeout_s)
        except TimeoutError:
            await self._stop(TIMEOUT)
        return await self._finish()

    async def kill(self) -> None:
        if self._exit is None:
            await self._stop(KILLED)
            await self._finish()

    async def _finish(self) -> ScaffoldExit:
        if self._exit is not None:
            return self._exit
        try:  # a grandchild that left the group may hold the pipe open
            await asyncio.wait_for(asyncio.shield(self._reading), KILL_GRACE_S)
        except TimeoutError:
            self._reading.cancel()
        code = self.process.returncode
        cause = self.cause or (EXITED if code == 0 else CRASHED)
        text = self.output.text()
        self.log_path.write_text(text, encoding="utf-8")
        self._exit = ScaffoldExit(
            cause=cause, exit_code=code if cause in (EXITED, CRASHED) else None,
            duration_s=time.monotonic() - self.started_s, num_output_bytes=self.num_output_bytes,
            log_tail=text[-NUM_TAIL_CHARS:], log_path=self.log_path)
        return self._exit


class SandboxProcess:
    """A scaffold running inside the sandbox as one shell command."""

    def __init__(self, sandbox: Sandbox, command: str, env: Mapping[str, str], log_path: Path,
                 user: str | None = None):
        self.sandbox = sandbox
        self.log_path = log_path
        self.started_s = time.monotonic()
        # The runner's time limit is applied in `wait`; this bound only stops a lost exec.
        self._task = asyncio.ensure_future(
            sandbox.exec(command, timeout_s=7 * 24 * 3600, env=dict(env), user=user))
        self._exit: ScaffoldExit | None = None

    async def wait(self, timeout_s: float) -> ScaffoldExit:
        if self._exit is not None:
            return self._exit
        try:
            result = await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            return await self._end(TIMEOUT)
        cause = EXITED if result.exit_code == 0 else CRASHED
        return self._record(cause, result.exit_code, result.output)

    async def kill(self) -> None:
        if self._exit is None:
            await self._end(KILLED)

    async def _end(self, cause: str) -> ScaffoldExit:
        await stop_sandbox_processes(self.sandbox)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        return self._record(cause, None, "")

    def _record(self, cause: str, exit_code: int | None, output: str) -> ScaffoldExit:
        self.log_path.write_text(output, encoding="utf-8")
        self._exit = ScaffoldExit(cause=cause, exit_code=exit_code,
                                  duration_s=time.monotonic() - self.started_s,
                                  num_output_bytes=len(output.encode()),
                                  log_tail=output[-NUM_TAIL_CHARS:], log_path=self.log_path)
        return self._exit


async def stop_sandbox_processes(sandbox: Sandbox, timeout_s: float = 30) -> None:
    """Kills every process of the sandbox's user but its init and keep-alive.

    It runs as that user, not as root: sandboxes drop CAP_KILL, so root inside may not
    signal another user's processes, while a user may always signal its own."""
    await sandbox.exec(_STOP_ALL, timeout_s=timeout_s)
