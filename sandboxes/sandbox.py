"""One Docker container per session: the sandbox a scaffold works in (`Sandbox.start`,
`exec`, `diff`, `close`; `gc` removes what a crashed run left). Its limits, labels and diff:
docs/sandboxes.md#containers.
"""

import asyncio
import contextlib
import io
import os
import shlex
import socket
import struct
import tarfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath

import docker
import docker.errors
from docker.models.containers import Container

from undertow.sandboxes.artefacts import BUILD_ARTEFACTS
from undertow.sandboxes.connection import Connection
from undertow.sandboxes.errors import ContainerDied, HostLost, SandboxError
from undertow.sandboxes.output import BoundedOutput

SANDBOX_LABEL = "undertow.sandbox"
RUN_LABEL = "undertow.run"
SESSION_LABEL = "undertow.session"
OWNER_LABEL = "undertow.owner"  # "host:pid" of the process that started the container
MARKER_ENV = "UNDERTOW_EXEC"
# Every command in a sandbox sees these (the container's environment): no bytecode files
# in the repository when the agent runs its code or tests (`artefacts.py`).
SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
_KILL_GRACE_S = 10.0
_SIGNALLED_EXIT_CODES = (128 + 9, 128 + 15)  # SIGKILL, SIGTERM
_STOP_SETTLE_S = 1.0
# Every command runs under this wrapper, with a fresh marker in its environment. The
# marker survives `setsid`, double forks and `nohup`, so `sweep` finds the command's whole
# process tree by it. `sweep` uses bash builtins only (no fork), so it works even when a fork
# bomb has taken every process slot. It runs as the command's own user: reading another
# user's /proc/PID/environ needs CAP_SYS_PTRACE, even as root.
# A round that kills nothing proves nothing while processes change under it, so `sweep`
# looks again (for up to 2 s) while one was started during the round (its parent may have
# forked it and exited before the round read the parent), or one exec'ed while the round read
# its environ (the read ends early; /proc/PID/stat's env_start and env_end, fields 50 and 51,
# change) or had not finished an exec (env_end is still 0).
_SWEEP = r"""
sweep() {
  local round pid entry found busy listed now deadline
  local -a before after
  now=${EPOCHREALTIME//[!0-9]/}
  deadline=$((${now:-0} + 2000000))
  for ((round = 0; round < 200; round++)); do
    found=0 busy=0 listed=" "
    for pid in /proc/[0-9]*; do
      listed+="$pid "
      pid=${pid#/proc/}
      [ "$pid" = "$$" ] && continue
      entry=
      read -r entry 2>/dev/null < "/proc/$pid/stat"
      before=(${entry##*) })
      while IFS= read -r -d '' entry; do
        if [ "$entry" = "UNDERTOW_EXEC=$UNDERTOW_EXEC" ]; then
          kill -9 "$pid" 2>/dev/null; found=1; continue 2
        fi
      done 2>/dev/null < "/proc/$pid/environ" || continue
      entry=
      read -r entry 2>/dev/null < "/proc/$pid/stat"
      after=(${entry##*) })
      [[ ${after[0]} == [ZX]* ]] && continue
      [[ "${before[47]}:${before[48]}" != "${after[47]}:${after[48]}" || ${after[48]} == 0 ]] &&
        busy=1
    done
    for pid in /proc/[0-9]*; do
      [[ $listed == *" $pid "* ]] || busy=1
    done
    ((found)) && continue
    ((busy)) || return 0
    now=${EPOCHREALTIME//[!0-9]/}
    ((${now:-0} < deadline)) || return 0
  done
  return "$found"
}
"""
_WRAPPER = _SWEEP + r"""
bash -c "$1"
status=$?
[ -n "$UNDERTOW_KEEP_BACKGROUND" ] || sweep
exit $status
"""


def read_exec(api: docker.APIClient, exec_id: str, output: BoundedOutput) -> None:
    """Starts the exec and adds its output to `output` until it ends. The frames are read
    from the response's buffered reader, not (as the SDK's stream does) from the socket
    beneath it: frames that came in with the response's headers wait in that buffer, and
    the SDK's stream lost them, a quick command's first lines or its whole output (3 execs
    in 1,120 here under load, the exit code still 0)."""
    stream = api.exec_start(exec_id, stream=True)   # its status checked; not read from
    # The typeshed stub of CancellableStream leaves out `_response`, which the SDK sets.
    response = stream._response  # pyright: ignore[reportAttributeAccessIssue]
    try:
        reader = response.raw._fp.fp   # http.client's buffered reader of the socket
        # A command may be silent for long: no read timeout, as the SDK's stream had none.
        api._disable_socket_timeout(reader.raw)  # pyright: ignore[reportAttributeAccessIssue]
        for chunk in exec_frames(reader):
            output.add(chunk)
    finally:
        # The SDK leaves closing a streamed response to its caller, and `stream.close()`
        # alone leaves the response's file object (and so its socket) open.
        stream.close()
        response.close()


def exec_frames(reader: io.BufferedIOBase) -> Iterator[bytes]:
    """The payloads of a non-TTY exec's output stream, read from `reader` until it ends:
    Docker's multiplexed frames, each an 8-byte header (the stream, 3 zero bytes, the
    payload's size, big-endian) and its payload."""
    while len(header := reader.read(8)) == 8:
        size = struct.unpack(">BxxxL", header)[1]
        payload = reader.read(size)
        if payload:
            yield payload
        if len(payload) < size:
            return


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation of one sandbox container.

    `user` None keeps the image's user (task images built here run as `agent`,
    uid 1000; published images choose their own). `network` is a Docker network
    mode; "none" by default. `git_history` is what a session's agent sees of the
    repository's history after set-up (`task_setup.py`): "squash" (default) leaves one
    commit holding the start state and removes every other commit, ref and object, so
    that a fix in the history (SWE-smith's `main`, a clone's later commits) cannot be
    read back and rewarded; "keep" leaves the image's history as it is.
    """

    num_cpus: float = 1.0
    memory_bytes: int = 2 * 2**30
    pids_limit: int = 512
    network: str = "none"
    user: str | None = None
    max_output_bytes: int = 256 * 2**10
    start_timeout_s: float = 60.0
    git_history: str = "squash"

    def __post_init__(self):
        for name in ("num_cpus", "memory_bytes", "pids_limit", "max_output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"SandboxConfig.{name} must be positive, got {getattr(self, name)}")
        if self.git_history not in ("squash", "keep"):
            raise ValueError(f"SandboxConfig.git_history must be 'squash' or 'keep', "
                             f"got {self.git_history!r}")


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command: exit code, merged stdout/stderr (bounded), and flags."""

    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    killed_by: str = field(default="", repr=False)


class Sandbox:
    """A running container for one session. Use `await Sandbox.start(...)`, then `close()`."""

    def __init__(self, connection: Connection, container: Container, workdir: str, base_commit: str,
                 config: SandboxConfig, uid: int, gid: int):
        self.connection = connection
        self.container = container
        self.workdir = workdir
        self.base_commit = base_commit
        self.config = config
        self.uid, self.gid = uid, gid
        self.gateway_url: str | None = None

    @property
    def container_id(self) -> str:
        """The container's full ID (the SDK types it Optional; a started container has one)."""
        assert self.container.id is not None, f"container {self.container.name} has no ID"
        return self.container.id

    @classmethod
    async def start(cls, connection: Connection, image: str, *, run: str, session: str,
                    workdir: str = "/testbed", base_commit: str = "",
                    config: SandboxConfig = SandboxConfig(), mounts: dict | None = None,
                    ) -> "Sandbox":
        """Starts the container and waits until a command runs in it."""
        labels = {SANDBOX_LABEL: "1", RUN_LABEL: run, SESSION_LABEL: session,
                  OWNER_LABEL: _owner()}
        try:
            # `user=None` keeps the image's user: the SDK leaves None fields out of the request.
            container = await connection.call(
                connection.client.containers.run, image, ["sleep", "infinity"], detach=True,
                init=True, labels=labels, network_mode=config.network,
                nano_cpus=int(config.num_cpus * 1e9), mem_limit=config.memory_bytes,
                memswap_limit=config.memory_bytes, pids_limit=config.pids_limit,
                working_dir=workdir, security_opt=["no-new-privileges"], volumes=mounts or {},
                environment=SANDBOX_ENV, user=config.user)
        except docker.errors.ImageNotFound:
            raise SandboxError(f"image {image} not found: build or pull it first") from None
        except docker.errors.APIError as error:
            raise SandboxError(f"could not start a container from {image}: {error}") from None
        sandbox = cls(connection, container, workdir, base_commit, config, uid=0, gid=0)
        try:
            await sandbox._ready()
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def _ready(self) -> None:
        workdir = shlex.quote(self.workdir)
        probe = f"id -u; id -g; git -C {workdir} rev-parse HEAD 2>/dev/null || true"
        result = await self.exec(probe, timeout_s=self.config.start_timeout_s)
        lines = result.output.split()
        if result.exit_code != 0 or len(lines) < 2:
            why = (f"did not answer within {self.config.start_timeout_s:g} s (start_timeout_s)"
                   if result.timed_out else f"exited with code {result.exit_code}")
            raise SandboxError(f"container {self.container.short_id} is not ready: its first "
                               f"command ({probe!r}) {why}, output "
                               f"{result.output.strip()[-500:] or '(none)'!r}")
        self.uid, self.gid = int(lines[0]), int(lines[1])
        if not self.base_commit and len(lines) > 2:
            self.base_commit = lines[2]

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _state(self) -> dict:
        try:
            await self.connection.call(self.container.reload)
        except docker.errors.NotFound:
            return {"Status": "removed"}
        return self.container.attrs.get("State", {})

    async def _stopped(self) -> bool:
        """Whether the container has stopped. Docker may record the end of a command killed
        with its container before the container's own end, so a container still running
        is asked again for up to `_STOP_SETTLE_S`."""
        deadline = time.monotonic() + _STOP_SETTLE_S
        while (await self._state()).get("Status") == "running":
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _died(self) -> ContainerDied:
        state = await self._state()
        detail = ", killed for exceeding its memory limit" if state.get("OOMKilled") else ""
        return ContainerDied(
            f"sandbox container {self.container.short_id} is {state.get('Status')} (exit code "
            f"{state.get('ExitCode')}{detail}); the session cannot continue in it")

    async def _exec_create(self, argv: list[str], user: str, workdir: str | None, env: dict) -> str:
        api = self.connection.client.api
        try:
            created = await self.connection.call(
                api.exec_create, self.container_id, argv, user=user, environment=env,
                workdir=workdir or self.workdir)
        except docker.errors.NotFound:
            raise await self._died() from None
        except docker.errors.APIError as error:
            if (await self._state()).get("Status") != "running":
                raise await self._died() from None
            raise SandboxError(
                f"cannot run a command in {self.container.short_id}: {error}") from None
        return created["Id"]

    async def exec(self, command: str, timeout_s: float, *, user: str | None = None,
                   workdir: str | None = None, env: dict[str, str] | None = None,
                   keep_background: bool = False) -> ExecResult:
        """Runs `command` with bash; past `timeout_s` its whole process tree is killed, and the
        call returns with `timed_out` set: an agent's command running too long is an ordinary
        outcome, not an error.

        When the command ends, processes it left running are killed too, unless
        `keep_background` (e.g. to start a server for later commands; redirect its output,
        or this call waits for it as `docker exec` does). Returns the exit code (124 on
        timeout, as `timeout(1)` does) and the merged, bounded output. Raises
        ContainerDied when the container is gone (also when it died under the command: a
        test run cut short that way is no verdict), HostLost when its daemon is. Cancelling
        the call kills the command too.
        """
        marker = uuid.uuid4().hex
        environment = {**(env or {}), MARKER_ENV: marker}
        if keep_background:
            environment["UNDERTOW_KEEP_BACKGROUND"] = "1"
        argv = ["bash", "-c", _WRAPPER, "undertow-exec", command]
        exec_id = await self._exec_create(argv, user or "", workdir, environment)
        output = BoundedOutput(self.config.max_output_bytes)
        started = time.monotonic()
        reading = asyncio.ensure_future(self.connection.call(
            read_exec, self.connection.client.api, exec_id, output))
        timed_out, killed_by = False, ""
        try:
            await asyncio.wait_for(asyncio.shield(reading), timeout_s)
        except TimeoutError:
            timed_out = True
            killed_by = await self._kill_tree(marker, user or "")
            try:
                await asyncio.wait_for(reading, _KILL_GRACE_S)
            except TimeoutError:
                raise SandboxError(
                    f"a command in {self.container.short_id} ran past its {timeout_s:g} s limit "
                    f"and its output had not ended {_KILL_GRACE_S:g} s after its processes "
                    f"were killed ({killed_by}): {command[:200]!r}") from None
        except asyncio.CancelledError:
            # The caller gave up (e.g. its session's time ran out): the command must not
            # outlive the call.
            await asyncio.shield(self._kill_tree(marker, user or ""))
            raise
        except docker.errors.APIError:
            raise await self._died() from None
        inspected = await self.connection.call(self.connection.client.api.exec_inspect, exec_id)
        exit_code = inspected.get("ExitCode")
        # A command killed because its container died (docker kill, docker stop, the daemon
        # shutting down) ends like one killed inside it: only the container's state tells.
        if exit_code is None or (not timed_out and exit_code in _SIGNALLED_EXIT_CODES
                                 and await self._stopped()):
            raise await self._died()
        return ExecResult(124 if timed_out else exit_code, output.text(), timed_out,
                          output.truncated, time.monotonic() - started, killed_by)

    async def _kill_tree(self, marker: str, user: str) -> str:
        """Kills every process carrying `marker`; restarts the container if that cannot be done."""
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline:
            try:
                exec_id = await self._exec_create(["bash", "-c", _SWEEP + "sweep"], user, "/",
                                                  {MARKER_ENV: marker})
                await self.connection.call(self.connection.client.api.exec_start, exec_id)
                inspected = await self.connection.call(
                    self.connection.client.api.exec_inspect, exec_id)
                if inspected.get("ExitCode") == 0:
                    return "marker"
            except (ContainerDied, HostLost):
                raise
            except (SandboxError, docker.errors.APIError):
                pass  # e.g. no process slot left for the killer: retry, then restart
            await asyncio.sleep(0.2)
        # Killing PID 1 (the init) makes the kernel kill every process in the container.
        await self.connection.call(self.container.restart, timeout=0)
        return "restart"

    def _path(self, path: str) -> PurePosixPath:
        return PurePosixPath(self.workdir) / path

    async def read_file(self, path: str) -> bytes:
        """The bytes of a file in the container (relative paths are under the workdir)."""
        full = self._path(path)
        try:
            chunks, _ = await self.connection.call(self.container.get_archive, str(full))
            data = await self.connection.call(lambda: b"".join(chunks))
        except docker.errors.NotFound:
            if (await self._state()).get("Status") != "running":
                raise await self._died() from None
            raise FileNotFoundError(
                f"no file {full} in sandbox {self.container.short_id}") from None
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            member = archive.next()
            if member is None or not member.isfile():
                raise IsADirectoryError(
                    f"{full} in sandbox {self.container.short_id} is not a file")
            extracted = archive.extractfile(member)
            assert extracted is not None, "a regular file's member always extracts"
            return extracted.read()

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Writes a file owned by the sandbox's user, creating its folder if needed."""
        full = self._path(path)
        if isinstance(data, str):
            data = data.encode("utf-8", errors="surrogateescape")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as archive:
            info = tarfile.TarInfo(full.name)
            info.size, info.mode, info.uid, info.gid = len(data), mode, self.uid, self.gid
            info.mtime = int(time.time())
            archive.addfile(info, io.BytesIO(data))
        try:
            try:
                await self.connection.call(self.container.put_archive, str(full.parent),
                                           buffer.getvalue())
            except docker.errors.NotFound:  # its folder does not exist yet
                await self.exec(f"mkdir -p {shlex.quote(str(full.parent))}", timeout_s=30)
                await self.connection.call(self.container.put_archive, str(full.parent),
                                           buffer.getvalue())
        except docker.errors.APIError as error:
            raise SandboxError(
                f"cannot write {full} in {self.container.short_id}: {error}") from None

    async def diff(self, timeout_s: float = 120) -> str:
        """Every change against the base commit (new, deleted, binary files), as a git diff,
        without the build artefacts the base commit does not have (`artefacts.py`).

        A throwaway index is used, so the agent's own index and staging are untouched. The
        artefacts are ignored on top of the repository's and the user's own ignore rules.
        Bytes that are not UTF-8 are kept through `surrogateescape`, so
        `write_file(path, diff)` reproduces the diff exactly.
        """
        if not self.base_commit:
            raise SandboxError(f"no base commit known for {self.workdir}: is it a git repository?")
        name = f"/tmp/undertow-diff-{uuid.uuid4().hex}"
        base = shlex.quote(self.base_commit)
        patterns = " ".join(shlex.quote(pattern) for pattern in BUILD_ARTEFACTS)
        user_ignores = ('"$(git config --path core.excludesFile || '
                        'echo "${XDG_CONFIG_HOME:-$HOME/.config}/git/ignore")"')
        script = (f"set -e; export GIT_INDEX_FILE={name}.index; "
                  f"{{ printf '%s\\n' {patterns}; cat {user_ignores} 2>/dev/null || true; }} "
                  f"> {name}.ignore; git read-tree {base}; "
                  f"git -c core.excludesFile={name}.ignore add -A; "
                  f"git diff --cached --binary --no-color {base} > {name}; "
                  f"rm -f {name}.index {name}.ignore")
        result = await self.exec(script, timeout_s)
        if result.exit_code != 0:
            raise SandboxError(f"git diff failed in {self.container.short_id}: {result.output}")
        data = await self.read_file(name)
        await self.exec(f"rm -f {name}", timeout_s=30)
        return data.decode("utf-8", errors="surrogateescape")

    async def close(self) -> None:
        """Removes the container and its anonymous volumes (an image's `VOLUME`s, which
        `docker rm` alone leaves behind: one per session); idempotent."""
        try:
            await self.connection.call(self.container.remove, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as error:
            if "already in progress" not in str(error):
                raise


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _orphaned(labels: dict[str, str]) -> bool:
    """Whether the process that started a container is gone (only knowable on its own host)."""
    host, _, pid = labels.get(OWNER_LABEL, "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


async def gc(connection: Connection, run: str | None = None, orphans_only: bool = False) -> int:
    """Removes sandbox containers; returns how many.

    `run` limits it to one run's containers. `orphans_only` keeps those whose starting
    process still lives on this host, so that a run's start-up can clear what crashed
    runs left without touching a run still going.
    """
    labels = [SANDBOX_LABEL] + ([f"{RUN_LABEL}={run}"] if run is not None else [])
    containers = await connection.call(
        connection.client.containers.list, all=True, filters={"label": labels})
    if orphans_only:
        containers = [c for c in containers if _orphaned(c.labels)]
    for container in containers:
        with contextlib.suppress(docker.errors.NotFound):
            await connection.call(container.remove, force=True, v=True)
    return len(containers)
