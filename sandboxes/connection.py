"""The connection to the Docker daemon, shared by every sandbox of a run: the SDK's blocking
calls, each in a thread of the connection's own pool (`Connection.call`).
"""

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import docker
import requests

from undertow.sandboxes.errors import HostLost

DEFAULT_DOCKER_URL = "unix:///var/run/docker.sock"
T = TypeVar("T")
P = ParamSpec("P")


class Connection:
    """A Docker client plus the thread pool its blocking calls run in; `url` names the
    daemon as `connect` was given it (programs that reach a sandbox themselves use it).

    The pool is its own, sized for many long-running `exec` streams at once: asyncio's
    default pool has a few threads, and one stuck stream per session would starve it."""

    def __init__(self, client: docker.DockerClient, max_threads: int = 256, url: str = ""):
        self.client, self.url = client, url
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="undertow-docker")

    async def call(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs one blocking SDK call in the pool; raises HostLost naming the daemon when
        it is out of reach (refused, reset, its socket gone), so that every caller tells a
        lost host from an error of the call itself."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor, functools.partial(function, *args, **kwargs))
        except requests.exceptions.ConnectionError as error:
            raise HostLost(f"the Docker daemon at {self.url or 'the default socket'} does not "
                           f"answer ({type(error).__name__}: {error}); its sandboxes are lost "
                           "with it: check the daemon, then `undertow sandbox gc` its "
                           "containers once it answers") from error

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def connect(base_url: str | None = None, timeout_s: float = 300,
            max_threads: int = 256) -> Connection:
    """Connects to the daemon at `base_url` (the command line passes DOCKER_HOST, if set).

    An ssh:// URL goes through the system's `ssh` client (its keys and config), as the
    docker command line does."""
    url = base_url or DEFAULT_DOCKER_URL
    client = docker.DockerClient(base_url=url, timeout=int(timeout_s), max_pool_size=max_threads,
                                 use_ssh_client=url.startswith("ssh://"))
    return Connection(client, max_threads, url)
