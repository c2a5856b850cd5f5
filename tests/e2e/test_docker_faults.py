"""Docker faults under a rollout (issue 35, item 8): a sandbox container killed mid-session
(`docker kill`), and a Docker host lost mid-session (its dockerd SIGKILLed).

Either way the session is `error:sandbox`: Undertow's failure, closed at the gateway with
`infra_failure: true`, which the learner never trains (`learner/advantages.py`), and its
slot runs again on a host that answers; a lost host is marked down and not chosen again.
Nothing is left behind: no container of the run, no anonymous volume (the task image
declares a `VOLUME`, as published images may), no relay folder on this machine.

The scaffold waits for a file before it ends: one in the relay's folder, the one folder of
this machine a sandbox linked to the gateway sees (`/run/undertow`), for a scaffold run in
its sandbox; one on this machine for a scaffold run here (as mini-swe-agent is). The test
kills what it kills while the first attempt waits, then lets every attempt end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import subprocess
import time
from pathlib import Path

import docker
import docker.errors
import pytest

from tests.adapters.conftest import scripted_gateway  # noqa: F401
from tests.sandboxes.conftest import build_volume_image, write_task_set
from tests.sandboxes.second_daemon import second_daemon  # noqa: F401
from undertow.adapters.command import CommandScaffold
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.rollout import Rollout, RolloutConfig
from undertow.adapters.summary import SessionResult
from undertow.learner.advantages import is_infra_failure
from undertow.sandboxes.base_image import build_base_image
from undertow.sandboxes.connection import DEFAULT_DOCKER_URL, connect
from undertow.sandboxes.hosts import DockerHosts, HostsConfig
from undertow.sandboxes.link import SOCKET_DIR_IN_CONTAINER
from undertow.sandboxes.sandbox import RUN_LABEL
from undertow.sandboxes.task import Task, load_tasks
from undertow.sandboxes.task_image import ensure_task_image

pytestmark = [
    pytest.mark.asyncio(loop_scope="session"),  # the fixtures' loop
    pytest.mark.docker,
    pytest.mark.slow,
    # The SDK's unix transport leaks the socket of a connect that fails (docker 7.2), as
    # every call to the killed daemon's socket does (tests/sandboxes/test_hosts.py).
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]
GATE = "go"
WAITING = CommandScaffold(f"while [ ! -e {SOCKET_DIR_IN_CONTAINER}/{GATE} ]; do sleep 0.2; done",
                          where="sandbox")
WAIT_S = 300


@pytest.fixture(autouse=True)
def collect_leaked_sockets():
    """The leaked sockets' warnings show up here, within this module's tests."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def volume_task(tmp_path_factory) -> Task:
    """The sandbox tests' task, on an image of it that declares an anonymous volume."""
    task = load_tasks(write_task_set(tmp_path_factory.mktemp("taskset")))[0]

    async def build() -> str:
        with connect() as connection:
            await build_base_image(connection)
            return await ensure_task_image(connection, task)

    client = docker.from_env()
    try:
        image = build_volume_image(client, asyncio.run(build()))
    finally:
        client.close()
    return dataclasses.replace(task, image=image)


@pytest.fixture
def local_client():
    client = docker.from_env()
    yield client
    client.close()


def _dangling_volumes(client: docker.DockerClient) -> set[str]:
    return {volume.name for volume in client.volumes.list(filters={"dangling": True})}


def _config(tmp_path: Path) -> RolloutConfig:
    return RolloutConfig(group_size=1, concurrency=1, max_attempts=2, timeout_s=600,
                         out_dir=tmp_path, progress_interval_s=0)


async def _waiting_container(client: docker.DockerClient, run: str, running: asyncio.Future):
    """The run's container whose scaffold waits at the gate."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert not running.done(), running.result()
        for container in client.containers.list(filters={"label": f"{RUN_LABEL}={run}"}):
            try:
                processes = container.top(ps_args="-ww -eo pid,args")["Processes"] or []
            except docker.errors.APIError:  # it ended meanwhile
                continue
            if any(f"{SOCKET_DIR_IN_CONTAINER}/{GATE}" in " ".join(p) for p in processes):
                return container
        await asyncio.sleep(0.5)
    pytest.fail(f"no scaffold of run {run} waited at its gate within {WAIT_S} s")


def _relay_dir(container) -> Path:
    (source,) = [mount["Source"] for mount in container.attrs["Mounts"]
                 if mount["Destination"] == SOCKET_DIR_IN_CONTAINER]
    return Path(source)


async def _assert_failed_as_undertows(admin: GatewayAdmin, result: SessionResult,
                                      error_type: str) -> None:
    assert (result.attempt, result.cause) == (0, "error:sandbox"), (result.cause, result.error)
    assert result.error.startswith(error_type), result.error
    session = await admin.session(result.session_id)
    assert session["closed"]
    meta = session["meta"]
    assert (meta["cause"], meta["infra_failure"]) == ("error:sandbox", True)
    assert is_infra_failure(meta)  # the learner's rule: no advantage, never in the loss


def _run_containers(client: docker.DockerClient, run: str) -> list:
    return client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={run}"})


async def test_a_container_killed_mid_session_is_a_sandbox_failure_run_again(
        volume_task, scripted_gateway, local_client, tmp_path):  # noqa: F811
    volumes_before = _dangling_volumes(local_client)
    with DockerHosts.connect(HostsConfig()) as hosts:
        rollout = Rollout([volume_task], WAITING, scripted_gateway.admin, hosts,
                          _config(tmp_path))
        running = asyncio.ensure_future(rollout.run())
        container = await _waiting_container(local_client, rollout.run_id, running)
        relay = _relay_dir(container)
        await asyncio.to_thread(container.kill)
        (relay / GATE).touch()
        summary = await running
        assert hosts.hosts[0].up  # the daemon answers: only the container died

    failed, rerun = summary.sessions
    await _assert_failed_as_undertows(scripted_gateway.admin, failed, "ContainerDied")
    assert (rerun.attempt, rerun.cause, rerun.index) == (1, "exited", failed.index)
    assert summary.outcomes == [rerun]
    assert _run_containers(local_client, rollout.run_id) == []
    assert _dangling_volumes(local_client) - volumes_before == set()
    assert not relay.exists()


async def test_a_container_killed_under_a_scaffold_on_the_host_is_a_sandbox_failure(
        volume_task, scripted_gateway, local_client, tmp_path):  # noqa: F811
    """The scaffold runs on the host, as mini-swe-agent does, and names its container in a
    file; it ends by itself (exit 0) after the kill: the session is still Undertow's failure,
    met where grading next touches the sandbox."""
    started, gate = tmp_path / "started", tmp_path / GATE
    scaffold = CommandScaffold(f"echo {{container}} >> {started}; "
                               f"while [ ! -e {gate} ]; do sleep 0.2; done")
    volumes_before = _dangling_volumes(local_client)
    with DockerHosts.connect(HostsConfig()) as hosts:
        rollout = Rollout([volume_task], scaffold, scripted_gateway.admin, hosts,
                          _config(tmp_path / "out"))
        running = asyncio.ensure_future(rollout.run())
        deadline = time.monotonic() + WAIT_S
        while not started.exists():
            assert not running.done(), running.result()
            assert time.monotonic() < deadline, "the scaffold did not start"
            await asyncio.sleep(0.2)
        container = local_client.containers.get(started.read_text().split()[0])
        await asyncio.to_thread(container.kill)
        gate.touch()
        summary = await running

    failed, rerun = summary.sessions
    await _assert_failed_as_undertows(scripted_gateway.admin, failed, "ContainerDied")
    assert (rerun.attempt, rerun.cause, rerun.index) == (1, "exited", failed.index)
    assert _run_containers(local_client, rollout.run_id) == []
    assert _dangling_volumes(local_client) - volumes_before == set()


@pytest.fixture
def second_client(second_daemon, volume_task):  # noqa: F811
    """A client of the second daemon, which holds the task's image (`docker save | load`)."""
    subprocess.run(["bash", "-o", "pipefail", "-c", f"docker save {volume_task.image} | "
                    f"docker -H {second_daemon.url} load -q"], check=True, capture_output=True)
    client = docker.DockerClient(base_url=second_daemon.url, version="auto")
    yield client
    client.close()


async def test_a_docker_host_lost_mid_session_is_marked_down_and_its_session_runs_elsewhere(
        second_daemon, second_client, volume_task, scripted_gateway, local_client,  # noqa: F811
        tmp_path):
    """The session starts on the second daemon (listed first, both empty), which is then
    killed; it comes back before the run ends, whose clean-up then clears it too."""
    volumes_before = _dangling_volumes(local_client)
    config = HostsConfig(docker_hosts=(second_daemon.url, DEFAULT_DOCKER_URL),
                         retry_down_s=3600)
    with DockerHosts.connect(config) as hosts:
        lost, live = hosts.hosts
        rollout = Rollout([volume_task], WAITING, scripted_gateway.admin, hosts,
                          _config(tmp_path))
        running = asyncio.ensure_future(rollout.run())
        container = await _waiting_container(second_client, rollout.run_id, running)
        relay = _relay_dir(container)
        await asyncio.to_thread(second_daemon.kill)
        await _waiting_container(local_client, rollout.run_id, running)
        assert not lost.up and live.up  # marked down before the slot ran again
        await asyncio.to_thread(second_daemon.start)
        (relay / GATE).touch()
        summary = await running
        assert lost.up  # it answered the run's clean-up

    failed, rerun = summary.sessions
    await _assert_failed_as_undertows(scripted_gateway.admin, failed, "HostLost")
    assert failed.details["docker_host"] == second_daemon.url
    assert (rerun.attempt, rerun.cause, rerun.index) == (1, "exited", failed.index)
    assert rerun.details["docker_host"] == DEFAULT_DOCKER_URL
    for client in (local_client, second_client):
        assert _run_containers(client, rollout.run_id) == []
    assert _dangling_volumes(local_client) - volumes_before == set()
    assert _dangling_volumes(second_client) == set()
    assert not relay.exists()
