"""A second Docker daemon on this machine, standing in for a second Docker host.

It runs beside the system one with its own socket, data root, exec root and pid file, no
bridge and no iptables, in a network namespace of its own (a dockerd without a bridge
deletes any `docker0` it sees, which would be the system daemon's). It starts with no
images: the rollout makes them there on first use (`DockerHosts.image`).

`Daemon.kill()` is a host lost: SIGKILL to it and its containerd, no shutdown, its
containers' processes left to their shims. `start()` brings the same daemon (same data
root) back, as a host that answers again. The fixture stops it cleanly at the end: back up
if it was killed, every container on it removed, SIGTERM, its mounts and folders gone; it
skips the test, saying why, where a daemon cannot be started here (not root, no dockerd or
unshare, dockerd exits).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import docker
import pytest
from docker.constants import DEFAULT_DOCKER_API_VERSION

from undertow.sandboxes.hosts import ping

START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 120


class DaemonUnavailable(Exception):
    """The second daemon could not be started here; the message says why."""


class Daemon:
    """A second dockerd: `url` is its socket; `start`, `kill` (host lost) and `stop`."""

    def __init__(self, root: Path):
        self.root = root
        self.url = f"unix://{root}/docker.sock"
        self.log = root / "dockerd.log"
        self.process: subprocess.Popen | None = None
        self.killed = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Starts dockerd (again, on the same data root) and waits until it answers."""
        (self.root / "docker.sock").unlink(missing_ok=True)  # a killed daemon's socket
        with self.log.open("ab") as output:
            self.process = subprocess.Popen(
                ["unshare", "--net", "dockerd", "--host", self.url,
                 "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                 "--pidfile", str(self.root / "docker.pid"), "--bridge=none",
                 "--iptables=false"],
                stdout=output, stderr=output, start_new_session=True)
        self.killed = False
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        client = docker.DockerClient(base_url=self.url, version=DEFAULT_DOCKER_API_VERSION,
                                     timeout=5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if not self.running:
                    raise DaemonUnavailable(f"dockerd exited: {self._log_tail()}")
                try:
                    ping(client, self.url, timeout_s=5)
                    return
                except Exception:  # no socket yet, or not answering yet
                    time.sleep(0.5)
        finally:
            client.close()
        raise DaemonUnavailable(f"dockerd did not answer within {START_TIMEOUT_S} s: "
                                f"{self._log_tail()}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill(self) -> None:
        """The host is lost: SIGKILL to dockerd and to the containerd it started, no
        shutdown. Returns once both are gone (a containerd still alive would be taken up
        by the next `start`, and then die under it)."""
        assert self.process is not None
        pid_file = self.root / "exec" / "containerd" / "containerd.pid"
        containerd_pid = int(pid_file.read_text()) if pid_file.exists() else None
        self.process.kill()
        self.process.wait()
        self.killed = True
        if containerd_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(containerd_pid, signal.SIGKILL)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while Path(f"/proc/{containerd_pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    def stop(self) -> None:
        """A clean shutdown: SIGTERM, then SIGKILL past STOP_TIMEOUT_S."""
        if not self.running:
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def remove_all(self) -> None:
        """Removes every container and volume of this daemon (it must be running)."""
        client = docker.DockerClient(base_url=self.url, version="auto")
        try:
            for container in client.containers.list(all=True):
                container.remove(force=True, v=True)
            client.volumes.prune()
        finally:
            client.close()

    def close(self) -> None:
        """Back up if it was killed (so that its containers' processes end), every
        container removed, stopped, its folders deleted."""
        try:
            if self.killed:
                self.start()
            if self.running:
                self.remove_all()
        finally:
            self.stop()
            self._unmount_data_root()
            shutil.rmtree(self.root, ignore_errors=True)

    def _unmount_data_root(self) -> None:
        """dockerd bind-mounts its data root on itself; a daemon that was killed, then
        started again, leaves that mount behind when it stops."""
        # os.path.ismount cannot tell a bind mount of a folder on itself: umount until
        # there is nothing mounted there (it fails then).
        data = self.root / "data"
        while subprocess.run(["umount", str(data)], capture_output=True).returncode == 0:
            pass


@pytest.fixture(scope="module")
def second_daemon():
    """A second dockerd for this test module (see the module docstring)."""
    missing = [tool for tool in ("dockerd", "unshare") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        pytest.skip(f"a second Docker daemon needs root and {', '.join(missing) or 'dockerd'}"
                    " here")
    daemon = Daemon(Path(tempfile.mkdtemp(prefix="ut-dockerd-", dir="/tmp")))  # short paths
    try:
        try:
            daemon.start()
        except DaemonUnavailable as error:
            pytest.skip(f"a second Docker daemon cannot be started here: {error}")
        yield daemon
    finally:
        daemon.close()
