"""Sandboxes on several Docker hosts (`sandboxes/hosts.py`).

Placement is checked on hosts that are never contacted. The Docker tests run a second
`dockerd` on this machine beside the system one (`second_daemon.py`). The base and task
images are made on it on first use (the base image by `docker import` of the shared
debootstrap tarball), `gc` clears both daemons, and a rollout whose second daemon is
stopped under its sessions closes those as Undertow's failures and runs them again on the
first (a daemon killed outright, and a container killed: tests/e2e/test_docker_faults.py).
"""

import asyncio
import gc
import time

import docker
import pytest
from docker.constants import DEFAULT_DOCKER_API_VERSION

from tests.adapters.conftest import run_containers, scripted_gateway  # noqa: F401
from tests.sandboxes.second_daemon import second_daemon  # noqa: F401
from undertow.adapters.command import CommandScaffold
from undertow.adapters.rollout import Rollout, RolloutConfig
from undertow.sandboxes.commands import collect_garbage
from undertow.sandboxes.connection import DEFAULT_DOCKER_URL, Connection
from undertow.sandboxes.errors import HostUnavailable
from undertow.sandboxes.hosts import DockerHost, DockerHosts, HostsConfig
from undertow.sandboxes.sandbox import RUN_LABEL, Sandbox

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),  # the fixtures' loop
    # The SDK's unix transport leaks the socket of a connect that fails (docker 7.2,
    # transport/unixconn.py), as every call to a stopped or absent daemon's socket does;
    # `collect_leaked_sockets` makes them show up here, within this module's tests.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(autouse=True)
def collect_leaked_sockets():
    yield
    gc.collect()


def _unreached(url: str) -> DockerHost:
    """A host whose client never contacts its daemon (the API version is given)."""
    client = docker.DockerClient(base_url=url, version=DEFAULT_DOCKER_API_VERSION)
    return DockerHost(url, Connection(client, url=url))


async def test_sessions_go_to_the_least_loaded_host_within_its_limit():
    hosts = DockerHosts([_unreached("unix:///tmp/a.sock"), _unreached("unix:///tmp/b.sock")],
                        HostsConfig(max_sessions_per_host=2))
    a, b = hosts.hosts
    with hosts:
        async with hosts.place() as first, hosts.place() as second, hosts.place() as third:
            assert (first, second, third) == (a, b, a)
            assert (a.num_sessions, b.num_sessions) == (2, 1)
            async with hosts.place() as fourth:
                assert fourth is b
                waiting = asyncio.ensure_future(hosts._claim())
                await asyncio.sleep(0.2)
                assert not waiting.done()  # both hosts are full
            assert await waiting is b  # the slot the fourth gave back
            b.num_sessions -= 1
        assert (a.num_sessions, b.num_sessions) == (0, 0)


async def test_a_host_that_does_not_answer_is_marked_down_and_skipped():
    up, gone = _unreached(DEFAULT_DOCKER_URL), _unreached("unix:///tmp/undertow-nowhere.sock")
    hosts = DockerHosts([gone, up], HostsConfig(retry_down_s=3600))
    with hosts:
        assert not await hosts.check(gone)
        assert "FileNotFoundError" in gone.error  # says why
        assert not gone.up
        for _ in range(3):
            async with hosts.place() as host:
                assert host is up
        up.down_since = time.monotonic()
        with pytest.raises(HostUnavailable, match="no Docker host answers"):
            async with hosts.place():
                pass


async def test_a_host_unreachable_at_start_starts_down():
    with DockerHosts.connect(HostsConfig(docker_hosts=("unix:///tmp/undertow-nowhere.sock",
                                                       ))) as hosts:
        (host,) = hosts.hosts
        assert not host.up and "FileNotFoundError" in host.error


@pytest.mark.docker
@pytest.mark.slow
async def test_images_are_made_on_each_host_once_and_gc_clears_every_host(
        second_daemon, fixture_task, docker_run, capsys):  # noqa: F811
    config = HostsConfig(docker_hosts=(DEFAULT_DOCKER_URL, second_daemon.url))
    run = f"{docker_run}-hosts"
    with DockerHosts.connect(config) as hosts:
        first, second = hosts.hosts
        tags = await asyncio.gather(*(hosts.image(host, fixture_task)
                                      for host in (first, second, second)))
        assert len(set(tags)) == 1
        image = second.connection.client.images.get(tags[0])
        assert image.labels["undertow.task"] == fixture_task.instance_id
        assert await hosts.image(second, fixture_task) == tags[0]
        for host in hosts.hosts:
            sandbox = await Sandbox.start(host.connection, tags[0], run=run, session="s")
            assert sandbox.base_commit == fixture_task.base_commit
        assert await hosts.gc(f"{run}-other") == {DEFAULT_DOCKER_URL: 0, second_daemon.url: 0}
        # `undertow sandbox gc --docker-host A --docker-host B --docker-host C --run RUN`
        urls = [DEFAULT_DOCKER_URL, second_daemon.url, "unix:///tmp/undertow-nowhere.sock"]
        status = await asyncio.to_thread(collect_garbage, urls, run, False)
        assert await hosts.gc(run) == {DEFAULT_DOCKER_URL: 0, second_daemon.url: 0}
    printed = capsys.readouterr()
    assert status == 1  # one host could not be cleared
    assert f"removed 1 sandbox container(s) of run {run} on {second_daemon.url}" in printed.out
    assert f"removed 1 sandbox container(s) of run {run} on {DEFAULT_DOCKER_URL}" in printed.out
    assert "could not clear unix:///tmp/undertow-nowhere.sock" in printed.err


def _running(hosts: DockerHosts, run: str) -> list[int]:
    return [len(host.connection.client.containers.list(filters={"label": f"{RUN_LABEL}={run}"}))
            for host in hosts.hosts]


@pytest.mark.docker
@pytest.mark.slow
async def test_a_host_stopped_mid_run_fails_its_sessions_as_undertows_and_they_run_elsewhere(
        second_daemon, fixture_task, scripted_gateway, tmp_path):  # noqa: F811
    """Four sessions, at most two per host: two start on each. The second daemon stops
    under its two; they cannot be graded there, are closed as infrastructure failures
    (`error:sandbox`, never an outcome) and run again on the first daemon, where every slot
    ends with an outcome."""
    gate = tmp_path / "go"
    scaffold = CommandScaffold(f"while [ ! -e {gate} ]; do sleep 0.2; done")
    config = HostsConfig(docker_hosts=(DEFAULT_DOCKER_URL, second_daemon.url),
                         max_sessions_per_host=2, retry_down_s=3600)
    rollout_config = RolloutConfig(group_size=4, concurrency=4, timeout_s=600,
                                   out_dir=tmp_path, progress_interval_s=0, max_attempts=2)
    with DockerHosts.connect(config) as hosts:
        rollout = Rollout([fixture_task], scaffold, scripted_gateway.admin, hosts,
                          rollout_config)
        running = asyncio.ensure_future(rollout.run())
        deadline = time.monotonic() + 300
        while _running(hosts, rollout.run_id) != [2, 2]:
            assert not running.done(), running.result()
            assert time.monotonic() < deadline, _running(hosts, rollout.run_id)
            await asyncio.sleep(0.5)
        await asyncio.to_thread(second_daemon.stop)
        gate.touch()
        summary = await running
        assert not hosts.hosts[1].up

    by_host = {}
    for result in summary.sessions:
        by_host.setdefault(result.details["docker_host"], []).append(result)
    failed = by_host[second_daemon.url]
    assert len(failed) == 2
    assert all(r.cause == "error:sandbox" and r.infra_failure and r.attempt == 0
               for r in failed), [(r.cause, r.error) for r in failed]
    assert sorted(r.index for r in summary.outcomes) == [0, 1, 2, 3]
    assert all(r.cause == "exited" and r.details["docker_host"] == DEFAULT_DOCKER_URL
               for r in summary.outcomes)
    assert summary.num_reruns == 2
    assert {r.index for r in summary.outcomes if r.attempt == 1} == {r.index for r in failed}
    for result in failed:
        session = await scripted_gateway.admin.session(result.session_id)
        assert session["closed"] and session["meta"]["infra_failure"] is True
    assert run_containers(rollout.run_id) == []
    gc.collect()  # the leaked sockets' warnings, while they are ignored
