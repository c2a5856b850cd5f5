"""One sandbox container: limits, isolation, exec time limits, files, diff, and clean-up."""

import asyncio
import re
import subprocess
import sys

import docker.errors
import pytest

from undertow.cli import main
from undertow.sandboxes.errors import ContainerDied
from undertow.sandboxes.sandbox import RUN_LABEL, SESSION_LABEL, Sandbox, SandboxConfig, gc

pytestmark = pytest.mark.docker


@pytest.fixture
async def sandbox(docker_connection, docker_run, fixture_image, fixture_task, request):
    config = getattr(request, "param", SandboxConfig())
    box = await Sandbox.start(docker_connection, fixture_image, run=docker_run,
                              session=request.node.name, config=config,
                              base_commit=fixture_task.base_commit)
    try:
        yield box
    finally:
        await box.close()


async def test_user_is_not_root_and_repo_is_at_base_commit(sandbox, fixture_task):
    result = await sandbox.exec("id -u; whoami; git rev-parse HEAD; git log --format=%H | wc -l",
                                timeout_s=30)
    uid, name, head, num_commits = result.output.split()
    assert (uid, name) == ("1000", "agent")
    assert head == fixture_task.base_commit and num_commits == "1"
    assert (await sandbox.exec("touch /etc/owned", timeout_s=30)).exit_code != 0


async def test_default_container_has_no_network(sandbox, host_bridge_ip):
    interfaces = await sandbox.exec("ls /sys/class/net", timeout_s=30)
    assert interfaces.output.split() == ["lo"]
    probe = (f"import socket; socket.create_connection(('{host_bridge_ip}', 2375), 3)")
    result = await sandbox.exec(f'python3 -c "{probe}"', timeout_s=30)
    assert result.exit_code != 0 and "Network is unreachable" in result.output


async def test_timeout_kills_the_whole_process_tree(sandbox):
    command = ("sleep 300 & (setsid sleep 301 &) ; (nohup sleep 302 >/dev/null 2>&1 &) ; "
               "echo started; sleep 303")
    result = await sandbox.exec(command, timeout_s=2)
    assert result.timed_out and result.exit_code == 124
    assert "started" in result.output
    left = await sandbox.exec("ps -e -o args=", timeout_s=30)
    assert not [line for line in left.output.splitlines() if line.startswith("sleep 30")]
    assert (await sandbox.exec("echo alive", timeout_s=30)).output == "alive\n"


async def test_background_processes_end_with_their_command_unless_kept(sandbox):
    # Repeated: the detached process execs twice (setsid, then sleep) while the sweep runs,
    # and a sweep that read its environ across an exec used to miss it now and then.
    for _ in range(20):
        await sandbox.exec("(setsid sleep 200 >/dev/null 2>&1 &)", timeout_s=30)
    await sandbox.exec("nohup sleep 201 >/dev/null 2>&1 &", timeout_s=30, keep_background=True)
    left = await sandbox.exec("ps -e -o args=", timeout_s=30)
    sleeps = [line for line in left.output.splitlines() if line.startswith("sleep 20")]
    assert sleeps == ["sleep 201"]


async def test_finished_command_returns_exit_code_and_output(sandbox):
    result = await sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=30)
    assert (result.exit_code, result.timed_out) == (3, False)
    assert sorted(result.output.split()) == ["err", "out"]


async def test_output_is_bounded_with_a_marker(docker_connection, docker_run, fixture_image):
    config = SandboxConfig(max_output_bytes=1000)
    async with await Sandbox.start(docker_connection, fixture_image, run=docker_run,
                                   session="bounded", config=config) as box:
        result = await box.exec("seq 1 100000", timeout_s=30)
    assert result.truncated and "bytes of output truncated" in result.output
    assert result.output.startswith("1\n2\n") and result.output.endswith("99999\n100000\n")


@pytest.mark.parametrize("sandbox", [SandboxConfig(pids_limit=64)], indirect=True)
async def test_fork_bomb_is_stopped_by_the_process_limit(sandbox):
    result = await sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 5", timeout_s=8)
    assert "Resource temporarily unavailable" in result.output or "retry" in result.output
    limit = await sandbox.exec(
        "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max", timeout_s=30)
    assert limit.output.strip() == "64"
    left = await sandbox.exec("ps -e -o comm=", timeout_s=30)
    # What remains: the init, `sleep infinity`, and this check's own wrapper and ps.
    assert sorted(left.output.split()) == ["bash", "docker-init", "ps", "sleep"]


@pytest.mark.parametrize("sandbox", [SandboxConfig(memory_bytes=256 * 2**20)], indirect=True)
async def test_memory_hog_is_killed_inside_the_container(sandbox):
    hog = "python3 -c \"chunks = [b'x' * 2**20 for _ in range(2048)]; print('survived')\""
    result = await sandbox.exec(hog, timeout_s=60)
    assert result.exit_code in (137, 1) and "survived" not in result.output
    assert (await sandbox.exec("echo alive", timeout_s=30)).output == "alive\n"
    state = (await sandbox._state())
    assert state["Status"] == "running"


async def test_files_and_diff_capture_every_change(sandbox, docker_connection, docker_run,
                                                   fixture_image, fixture_task):
    binary = bytes(range(256)) * 4
    await sandbox.write_file("data/blob.bin", binary)
    await sandbox.write_file("minimath/ops.py", "def add(a, b):\n    return b + a\n")
    await sandbox.exec("git rm -q tests/test_ops.py && git add -A", timeout_s=30)
    assert await sandbox.read_file("data/blob.bin") == binary
    with pytest.raises(FileNotFoundError):
        await sandbox.read_file("absent.txt")
    diff = await sandbox.diff()
    assert "new file mode" in diff and "GIT binary patch" in diff
    assert "deleted file mode" in diff and "+    return b + a" in diff
    async with await Sandbox.start(docker_connection, fixture_image, run=docker_run,
                                   session="replay") as replay:
        await replay.write_file("/tmp/change.diff", diff)
        applied = await replay.exec("git apply --binary /tmp/change.diff", timeout_s=30)
        assert applied.exit_code == 0, applied.output
        assert await replay.read_file("data/blob.bin") == binary
        assert await replay.diff() == diff


async def test_diff_holds_the_agents_sources_not_what_running_its_tests_left(sandbox):
    """The agent adds a module and its test and runs pytest; bytecode written anyway
    (compileall ignores PYTHONDONTWRITEBYTECODE) and an egg-info folder are there too."""
    assert (await sandbox.exec("echo $PYTHONDONTWRITEBYTECODE", 30)).output == "1\n"
    await sandbox.write_file("minimath/extra.py", "def triple(x):\n    return 3 * x\n")
    await sandbox.write_file("tests/test_extra.py", "from minimath.extra import triple\n\n\n"
                             "def test_triple():\n    assert triple(2) == 6\n")
    tests = await sandbox.exec("python -m pytest -q tests/test_extra.py", 120)
    assert tests.exit_code == 0, tests.output
    left = await sandbox.exec("find . -name __pycache__ -not -path './.git/*'; ls -a", 30)
    assert "__pycache__" not in left.output and ".pytest_cache" in left.output
    built = await sandbox.exec("python -m compileall -q minimath tests && mkdir -p "
                               "minimath.egg-info && echo x > minimath.egg-info/PKG-INFO", 60)
    assert built.exit_code == 0, built.output
    diff = await sandbox.diff()
    assert re.findall(r"^diff --git a/(\S+) b/", diff, re.MULTILINE) == [
        "minimath/extra.py", "tests/test_extra.py"]
    assert "GIT binary patch" not in diff


async def test_dead_container_is_reported_as_such(sandbox, docker_connection):
    await docker_connection.call(sandbox.container.kill)
    with pytest.raises(ContainerDied, match="is exited"):
        await sandbox.exec("true", timeout_s=30)


@pytest.mark.parametrize("end", ["kill", "stop"])
async def test_a_command_whose_container_dies_under_it_raises_container_died(
        sandbox, docker_connection, end):
    """`docker kill` or `docker stop` while a command runs: its exit status (137, 143) is
    no outcome of the command (a test run cut short so would grade as failed tests), where
    the same status from a command killed inside the running container is."""
    killed_inside = await sandbox.exec("kill -9 $$", timeout_s=60)
    assert (killed_inside.exit_code, killed_inside.timed_out) == (137, False)
    running = asyncio.ensure_future(sandbox.exec("sleep 120", timeout_s=600))
    for _ in range(300):
        top = await docker_connection.call(sandbox.container.top, ps_args="-eo pid,args")
        if any(process[-1] == "sleep 120" for process in top["Processes"]):
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the command did not start")
    if end == "kill":
        await docker_connection.call(sandbox.container.kill)
    else:
        await docker_connection.call(sandbox.container.stop, timeout=1)
    with pytest.raises(ContainerDied, match="is exited"):
        await running


async def test_container_is_removed_when_the_session_fails_midway(
        docker_connection, docker_run, fixture_image):
    with pytest.raises(RuntimeError, match="scaffold crashed"):
        async with await Sandbox.start(docker_connection, fixture_image, run=docker_run,
                                       session="crashing") as box:
            container_id = box.container.id
            raise RuntimeError("scaffold crashed")
    with pytest.raises(docker.errors.NotFound):
        docker_connection.client.containers.get(container_id)


async def test_close_removes_the_anonymous_volumes_of_its_image(docker_connection, docker_run,
                                                              volume_image):
    box = await Sandbox.start(docker_connection, volume_image, run=docker_run, session="volume")
    try:
        await docker_connection.call(box.container.reload)
        (volume,) = [mount["Name"] for mount in box.container.attrs["Mounts"]
                     if mount["Type"] == "volume"]
    finally:
        await box.close()
    with pytest.raises(docker.errors.NotFound):
        docker_connection.client.volumes.get(volume)


def test_gc_removes_a_crashed_runs_containers_by_label(docker_connection, docker_run,
                                                      fixture_image, capsys):
    crashed_run = f"{docker_run}-crashed"
    crash = (
        "import asyncio, os\n"
        "from undertow.sandboxes.connection import connect\n"
        "from undertow.sandboxes.sandbox import Sandbox\n"
        f"asyncio.run(Sandbox.start(connect(), {fixture_image!r}, run={crashed_run!r}, "
        "session='lost'))\n"
        "os._exit(1)\n")
    subprocess.run([sys.executable, "-c", crash], check=False, timeout=120)
    alive = asyncio.run(
        Sandbox.start(docker_connection, fixture_image, run=crashed_run, session="live"))
    try:
        # At a run's start-up: only the crashed process's container goes.
        assert asyncio.run(gc(docker_connection, crashed_run, orphans_only=True)) == 1
        left = docker_connection.client.containers.list(
            all=True, filters={"label": f"{RUN_LABEL}={crashed_run}"})
        assert [c.labels[SESSION_LABEL] for c in left] == ["live"]
    finally:
        assert main(["sandbox", "gc", "--run", crashed_run]) == 0
    assert "removed 1 sandbox container(s)" in capsys.readouterr().out
    with pytest.raises(docker.errors.NotFound):
        docker_connection.client.containers.get(alive.container.id)

async def test_cancelled_exec_kills_its_command(sandbox):
    running = asyncio.ensure_future(sandbox.exec("sleep 250", timeout_s=600))
    await asyncio.sleep(1.5)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    left = await sandbox.exec("ps -e -o args=", timeout_s=30)
    assert "sleep 250" not in left.output
