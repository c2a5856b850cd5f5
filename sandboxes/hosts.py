"""Sandboxes on several Docker hosts: placement, images per host, hosts that go away and
come back (docs/sandboxes.md#several-docker-hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import docker
from docker.constants import DEFAULT_DOCKER_API_VERSION

from undertow.sandboxes.connection import DEFAULT_DOCKER_URL, Connection, connect
from undertow.sandboxes.errors import HostUnavailable
from undertow.sandboxes.task import Task


@dataclass(frozen=True)
class HostsConfig:
    """Which Docker daemons run sandboxes, and how many sessions each may hold at once."""

    docker_hosts: tuple[str, ...] = ()
    max_sessions_per_host: int = 0
    probe_timeout_s: float = 10.0
    retry_down_s: float = 30.0

    def __post_init__(self):
        if self.max_sessions_per_host < 0:
            raise ValueError("HostsConfig.max_sessions_per_host must be >= 0 (0: no limit), "
                             f"got {self.max_sessions_per_host}")
        if len(set(self.docker_hosts)) != len(self.docker_hosts):
            raise ValueError(f"HostsConfig.docker_hosts names a host twice: {self.docker_hosts}")


@dataclass(eq=False)
class DockerHost:
    """One daemon: its connection, how many sessions it holds, and whether it is down."""

    url: str
    connection: Connection
    num_sessions: int = 0
    negotiated: bool = True   # False: the client was made while the daemon did not answer
    down_since: float | None = None
    error: str = ""
    images: dict[str, asyncio.Future] = field(default_factory=dict)

    @property
    def up(self) -> bool:
        return self.down_since is None


class DockerHosts:
    """The daemons of a run. Use `place()` per session; `close()` (or `with`) at the end."""

    def __init__(self, hosts: list[DockerHost], config: HostsConfig = HostsConfig()):
        if not hosts:
            raise ValueError("DockerHosts needs at least one host")
        self.hosts, self.config = hosts, config
        self._changed = asyncio.Condition()
        self._owned = False

    @classmethod
    def connect(cls, config: HostsConfig, default_url: str | None = None) -> DockerHosts:
        """Connects to every daemon of `config` (`default_url` when it names none)."""
        urls = config.docker_hosts or (default_url or DEFAULT_DOCKER_URL,)
        hosts = [_connect_host(url) for url in urls]
        placed = cls(hosts, config)
        placed._owned = True
        return placed

    @classmethod
    def of(cls, connection: Connection) -> DockerHosts:
        """One host over an existing connection (which the caller keeps and closes)."""
        return cls([DockerHost(connection.url or str(connection.client.api.base_url),
                               connection)])

    def close(self) -> None:
        if self._owned:
            for host in self.hosts:
                host.connection.close()

    def __enter__(self) -> DockerHosts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.asynccontextmanager
    async def place(self) -> AsyncIterator[DockerHost]:
        """Holds a slot on the least-loaded live host for the block's duration."""
        host = await self._claim()
        try:
            yield host
        finally:
            async with self._changed:
                host.num_sessions -= 1
                self._changed.notify_all()

    async def _claim(self) -> DockerHost:
        while True:
            await self._retry_down()
            async with self._changed:
                live = [host for host in self.hosts if host.up]
                if not live:
                    raise HostUnavailable(
                        "no Docker host answers: " + "; ".join(
                            f"{host.url or 'default'}: {host.error}" for host in self.hosts))
                limit = self.config.max_sessions_per_host
                free = [host for host in live if not limit or host.num_sessions < limit]
                if free:
                    host = min(free, key=lambda h: h.num_sessions)
                    host.num_sessions += 1
                    return host
                # Every live host is full: wait for a slot (or to ping the down ones again).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.config.retry_down_s)

    async def _retry_down(self) -> None:
        now = time.monotonic()
        due = [host for host in self.hosts
               if host.down_since is not None
               and now - host.down_since >= self.config.retry_down_s]
        for host in due:
            await self.check(host)

    async def check(self, host: DockerHost) -> bool:
        """Pings `host`; marks it down (or up again) by the answer. Returns whether it is up."""
        try:
            await asyncio.wait_for(host.connection.call(ping, host.connection.client, host.url,
                                                        self.config.probe_timeout_s),
                                   self.config.probe_timeout_s)
            if not host.negotiated:  # up for the first time: speak the daemon's API version
                stale, host.connection = host.connection, await asyncio.to_thread(
                    connect, host.url)
                host.negotiated = True
                stale.close()
        except Exception as error:  # refused, gone, timed out: all mean down
            if host.up:
                host.images.clear()  # a daemon that comes back may have lost them
            host.down_since, host.error = time.monotonic(), f"{type(error).__name__}: {error}"
            return False
        async with self._changed:
            host.down_since, host.error = None, ""
            self._changed.notify_all()
        return True

    async def image(self, host: DockerHost, task: Task) -> str:
        """The task's image on `host`, built there (with the base image) on first use."""
        from undertow.sandboxes.task_image import ensure_task_image

        pending = host.images.get(task.instance_id)
        if pending is None:
            pending = asyncio.ensure_future(ensure_task_image(host.connection, task))
            host.images[task.instance_id] = pending
        try:
            return await asyncio.shield(pending)
        except Exception:
            if host.images.get(task.instance_id) is pending:
                del host.images[task.instance_id]  # the next session tries again
            raise

    async def gc(self, run: str | None = None, orphans_only: bool = False,
                 ) -> dict[str, int | str]:
        """Removes sandbox containers on every host: per host, how many, or why it could not."""
        from undertow.sandboxes.sandbox import gc

        async def one(host: DockerHost) -> int | str:
            if not host.up and not await self.check(host):
                return host.error
            try:
                return await gc(host.connection, run, orphans_only)
            except Exception as error:  # one unreachable host must not stop the others
                return f"{type(error).__name__}: {error}"

        counts = await asyncio.gather(*(one(host) for host in self.hosts))
        return {host.url: count for host, count in zip(self.hosts, counts, strict=True)}


def ping(client: docker.DockerClient, url: str, timeout_s: float = 30) -> None:
    """Raises unless the daemon at `url` answers `GET /_ping` (unversioned: any API
    version does). A unix socket that is not there is reported without a connection
    attempt (the SDK leaks the socket of a failed unix connect)."""
    if url.startswith("unix://") and not os.path.exists(url.removeprefix("unix://")):
        raise FileNotFoundError(f"no Docker socket at {url}")
    response = client.api.get(f"{client.api.base_url}/_ping", timeout=timeout_s)
    try:
        response.raise_for_status()
    finally:
        response.close()


def _connect_host(url: str) -> DockerHost:
    """A host of the run; one that does not answer now starts down, with a client that
    asks the daemon its API version only when it answers (`DockerHosts.check`)."""
    probe = docker.DockerClient(base_url=url, version=DEFAULT_DOCKER_API_VERSION,
                                use_ssh_client=url.startswith("ssh://"))
    try:
        ping(probe, url)
    except Exception as error:  # refused, no socket, no route: the host is down for now
        return DockerHost(url, Connection(probe, url=url), negotiated=False,
                          down_since=time.monotonic(), error=f"{type(error).__name__}: {error}")
    probe.close()
    return DockerHost(url, connect(url))
