"""Makes sure a Docker daemon is reachable, starting one when allowed: as root it starts
`dockerd` (Debian's `docker.io`, from `make system-packages`); elsewhere it says what to do.
`make test` and `make run` run it (`python -m undertow.sandboxes.daemon`).
"""

import os
import shutil
import subprocess
import sys
import time

from undertow.sandboxes.errors import SandboxError

DOCKERD_LOG = "/var/log/undertow-dockerd.log"


class DaemonError(SandboxError, RuntimeError):
    """No Docker daemon can be reached and none could be started."""


def daemon_reachable() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    result = subprocess.run([docker, "info"], capture_output=True, timeout=30)
    return result.returncode == 0


def _start_dockerd(wait_s: float) -> None:
    with open(DOCKERD_LOG, "ab") as log:
        subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if daemon_reachable():
            return
        time.sleep(1)
    raise DaemonError(f"dockerd did not become ready in {wait_s:.0f} s; see {DOCKERD_LOG}")


def ensure_daemon(wait_s: float = 90) -> str:
    """Returns what was done; raises DaemonError when no daemon can be had."""
    if daemon_reachable():
        return "Docker daemon already running"
    if os.geteuid() != 0:
        raise DaemonError(
            "no Docker daemon is reachable and this is not root: start dockerd "
            "(or add your user to the docker group) and run again")
    if shutil.which("dockerd") is None:
        raise DaemonError("dockerd is not installed: run `make system-packages` as root "
                          "(it installs Debian's docker.io)")
    _start_dockerd(wait_s)
    return f"started dockerd (log: {DOCKERD_LOG})"


def main() -> int:
    try:
        print(ensure_daemon())
    except DaemonError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
