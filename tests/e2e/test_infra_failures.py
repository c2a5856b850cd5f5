"""Undertow's own failures never become the policy's reward (issue 35, item 3), end to end:
the rollout runner (`adapters/rollout.py`) with a real scaffold program
(`tripping_scaffold.py`: chat turns through the openai SDK, no retries, exit 1 on an error
reply, as a scaffold that does not handle errors ends) in real Docker sandboxes, the real
gateway and the built-in engine on the tiny model. One session meets a fault of Undertow's
at its second turn:

- its engine is killed (SIGKILL) after the group's first good calls: no engine, a 503;
- every engine is at its admission limit (one generation each, no wait): a 429;
- the store's disk is full (a 1 MiB tmpfs filled): the call is not kept, a 503.

The scaffold exits 1 (`crashed`, as the runner sees it); the session must be an infra
failure, decided by the gateway (the tree's session meta, which the learner reads, says
`infra_failure: true`, cause `error:gateway`, the scaffold's `crashed`, the reason), its
slot re-run as a new session that ends with an outcome, and none of its tokens trained
(the learner's advantages and packing leave it out). The fault is undone before the
failed scaffold exits (the file hooks of `tripping_scaffold.py`), so the re-run and the
other sessions run normally."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
import pytest

from tests.engines.conftest import LISTENING, STARTUP_TIMEOUT_S, _wait_healthy
from undertow.adapters.command import CommandScaffold
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.rollout import Rollout, RolloutConfig
from undertow.gateway.engine_pool.router import RouterConfig
from undertow.learner.advantages import group_advantages, valid_sessions
from undertow.learner.config import AdvantageConfig
from undertow.learner.packing import pack_step
from undertow.learner.trees import load_store_trees
from undertow.run.embedded import serve_gateway
from undertow.sandboxes.connection import connect
from undertow.sandboxes.task import load_tasks

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.asyncio(loop_scope="session")]

REPO = Path(__file__).resolve().parents[2]
SCAFFOLD = Path(__file__).with_name("tripping_scaffold.py")
NUM_TURNS, TRIP_TURN = 3, 1
WAIT_S = 300.0   # a bound on waiting for the run's steps, not a timing check


@contextlib.contextmanager
def builtin_engine(model_dir: Path):
    """A built-in engine serving the tiny model in its own process: (URL, process)."""
    command = [sys.executable, "-m", "undertow.cli", "engine", "serve", "--model",
               str(model_dir), "--port", "0", "num_threads=1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith(LISTENING), line
        url = line[len(LISTENING):].strip()
        _wait_healthy(url, process, time.monotonic() + STARTUP_TIMEOUT_S)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, so that the store's writes fail for real when it is full (as
    tests/gateway/test_store.py's); skipped only where no tmpfs can be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def fill(disk: Path) -> Path:
    """Writes a file until the disk refuses another byte; returns its path."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * size)
    return filler


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with builtin_engine(tiny_model_dir) as (url, _process):
        yield url


async def until(condition: Callable[[], bool], running: asyncio.Future, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if running.done():
            running.result()
            raise AssertionError(f"the rollout ended before {what}")
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.05)


async def tripped_rollout(admin: GatewayAdmin, control: Path, out_dir: Path,
                          fault: Callable[[], Awaitable[None]],
                          undo: Callable[[], Awaitable[None]], concurrency: int = 2
                          ) -> Rollout:
    """A group of two sessions of the first bundled task, `concurrency` at a time; the one
    that trips meets `fault` at its call of turn TRIP_TURN, and `undo` runs once that call
    has failed."""
    control.mkdir()
    task = sorted(load_tasks(REPO / "sandboxes" / "tasks" / "bundled"),
                  key=lambda t: t.instance_id)[0]
    scaffold = CommandScaffold(f"{sys.executable} {SCAFFOLD} {{base_url}} {{api_key}} "
                               f"{control} {NUM_TURNS} {TRIP_TURN}")
    config = RolloutConfig(group_size=2, concurrency=concurrency, timeout_s=WAIT_S, out_dir=out_dir,
                           progress_interval_s=0, max_attempts=2)
    with connect(os.environ.get("DOCKER_HOST")) as connection:
        rollout = Rollout([task], scaffold, admin, connection, config)
        running = asyncio.ensure_future(rollout.run())
        await until((control / "tripped").exists, running, "a session tripped")
        await fault()
        (control / "go").touch()
        await until((control / "called").exists, running, "the tripped call was answered")
        await undo()
        (control / "hold").unlink()
        (control / "release").touch()
        await running
    return rollout


def assert_failed_kept_rerun_and_untrained(rollout: Rollout, store_dir: Path,
                                           reason: str) -> None:
    [tree] = [t for t in load_store_trees(store_dir) if t.group_id.startswith(rollout.run_id)]
    results = rollout.results
    failed = [r for r in results if r.infra_failure]
    assert failed, [(r.index, r.attempt, r.cause, r.error) for r in results]
    for result in failed:
        meta = tree.sessions[result.session_id].meta
        assert (result.cause, meta["cause"], meta["infra_failure"]) == (
            "error:gateway", "error:gateway", True), meta
        assert meta["scaffold_cause"] == "crashed" and result.scaffold_cause == "crashed"
        assert reason in meta["infra_errors"], meta
        assert meta["grade_reason"] == ""   # not graded: its end was Undertow's doing
        assert any(r.index == result.index and r.attempt == result.attempt + 1
                   for r in results), "not re-run"
    tripped = next(r for r in failed if reason in tree.sessions[r.session_id].meta[
        "infra_errors"])
    assert tripped.attempt == 0
    last = {r.index: r for r in sorted(results, key=lambda r: r.attempt)}
    assert [last[index].cause for index in (0, 1)] == ["exited", "exited"]

    valid = valid_sessions(tree)
    assert set(valid) == {r.session_id for r in results if not r.infra_failure}
    assert all(not tree.sessions[s].meta.get("infra_errors") for s in valid)
    advantages = {(tree.group_id, session_id): value for session_id, value
                  in group_advantages(tree, AdvantageConfig()).items()}
    packed = pack_step([tree], advantages, max_tokens=4096)
    trained = {packed.session_keys[int(k)][1] for k in packed.term_session.unique()}
    assert trained == set(valid)
    assert not trained & {r.session_id for r in failed}


async def test_an_engine_killed_mid_group_fails_its_session_for_a_rerun(tiny_model_dir,
                                                                        tmp_path):
    store_dir = tmp_path / "store"
    with builtin_engine(tiny_model_dir) as (engine_url, process):
        async with (serve_gateway(tiny_model_dir, store_dir, [engine_url]) as gateway,
                    GatewayAdmin(gateway.url, gateway.admin_token) as admin):
            with contextlib.ExitStack() as replacements:

                async def kill_engine() -> None:
                    os.kill(process.pid, signal.SIGKILL)
                    await asyncio.to_thread(process.wait)

                async def add_engine() -> None:
                    url, _ = replacements.enter_context(builtin_engine(tiny_model_dir))
                    await admin._call("POST", "/admin/engines", {"url": url})

                rollout = await tripped_rollout(admin, tmp_path / "control", tmp_path,
                                                kill_engine, add_engine)
    assert_failed_kept_rerun_and_untrained(rollout, store_dir, "503 Unavailable")


async def test_a_429_fails_its_session_for_a_rerun(tiny_model_dir, engine, tmp_path):
    store_dir = tmp_path / "store"
    router = RouterConfig(max_in_flight_per_engine=1, admission_wait_s=0)
    async with (serve_gateway(tiny_model_dir, store_dir, [engine], router=router) as gateway,
                GatewayAdmin(gateway.url, gateway.admin_token) as admin):
        hog: list = []

        async def take_the_engine() -> None:
            """A long streamed call of another group holds the engine's one place."""
            opened = await admin.open_session("hog")
            client = openai.AsyncOpenAI(base_url=opened["base_url"],
                                        api_key=opened["api_key"], max_retries=0)
            deadline = time.monotonic() + WAIT_S
            while True:   # a call of the group's other session may hold the place still
                try:
                    stream = await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "go on"}],
                        stream=True, max_tokens=4000)
                    break
                except openai.RateLimitError:
                    assert time.monotonic() < deadline, "the engine never came free"
                    await asyncio.sleep(0.1)
            first = await anext(aiter(stream))
            assert first is not None
            hog.extend((stream, client))

        async def free_the_engine() -> None:
            """The long call's client leaves: the gateway aborts its generation, which
            frees the engine's place once the abort is through, as a short call of the
            hog's session that gets in shows."""
            stream, client = hog
            await stream.close()
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "done"}],
                        max_tokens=1)
                    break
                except openai.RateLimitError:
                    assert time.monotonic() < deadline, "the engine never came free"
                    await asyncio.sleep(0.1)
            await client.close()

        # One session at a time: with one place and no wait, the group's two sessions
        # would also refuse each other now and then (a 429 of no fault's), and a re-run
        # refused again is not re-run twice.
        rollout = await tripped_rollout(admin, tmp_path / "control", tmp_path,
                                        take_the_engine, free_the_engine, concurrency=1)
    assert_failed_kept_rerun_and_untrained(rollout, store_dir, "429 Busy")


async def test_a_full_store_disk_fails_its_session_for_a_rerun(tiny_model_dir, engine,
                                                               tmp_path, small_disk):
    store_dir = small_disk / "store"
    async with (serve_gateway(tiny_model_dir, store_dir, [engine]) as gateway,
                GatewayAdmin(gateway.url, gateway.admin_token) as admin):
        filler: list[Path] = []

        async def fill_the_disk() -> None:
            filler.append(fill(small_disk))

        async def free_the_disk() -> None:
            filler[0].unlink()

        rollout = await tripped_rollout(admin, tmp_path / "control", tmp_path, fill_the_disk,
                                        free_the_disk)
    assert_failed_kept_rerun_and_untrained(rollout, store_dir, "503 StoreUnavailable")
