"""The engine pool against real built-in engine processes (tiny model): sticky
routing, admission, resume after an engine is killed, pause modes around a weight
update, draining, adding and removing engines, the operator routes and metrics.

Greedy decoding (temperature 0) makes exactness checkable: a resumed stream must
equal what the engine produces uninterrupted from the same prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.scripted_engine import ScriptedEngine
from undertow.gateway.engine_pool.inflight import InFlightConfig
from undertow.gateway.engine_pool.migration import MigrationConfig
from undertow.gateway.engine_pool.pool import (
    EnginePool,
    GenerationChunk,
    PoolBusy,
    PoolConfig,
    PoolUnavailable,
    UnknownEngine,
)
from undertow.gateway.engine_pool.router import EngineState, RouterConfig
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.front.api.engines_admin import add_engine_routes
from undertow.gateway.metrics import GatewayMetrics

PROMPT = [5, 17, 42, 99, 123, 7, 64, 300]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def generate(pool: EnginePool, session_id: str, input_ids: list[int], params: SamplingParams,
             rid: str, *, live: bool = True):
    """`pool.generate` of an engine request as the gateway builds it (with logprobs)."""
    return pool.generate(session_id, GenerateRequest(input_ids=input_ids, sampling_params=params,
                                                     rid=rid, return_logprob=True), live=live)


@dataclass
class EngineProcess:
    """A built-in engine server started for a test; `kill()` is SIGKILL."""

    process: subprocess.Popen
    url: str

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)


def _die_with_parent() -> None:
    """Linux: the engine gets SIGKILL if the test process dies without its teardown."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_engine(model_dir: Path, log_path: Path, port: int = 0) -> EngineProcess:
    """Starts `undertow engine serve` and reads its URL from the line it prints."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "undertow.cli", "engine", "serve", "--model", str(model_dir),
             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        for line in log_path.read_text().splitlines():
            if "listening on" in line:
                return EngineProcess(process, line.split("listening on", 1)[1].strip())
        time.sleep(0.1)
    EngineProcess(process, "").kill()
    raise RuntimeError(f"engine did not start: {log_path.read_text()[-2000:]}")


@pytest.fixture
def engines(tiny_model_dir, tmp_path):
    """Starts engines on demand (`engines(n)`) and kills them all at teardown."""
    started: list[EngineProcess] = []

    def launch(num: int = 1, model_dir: Path = tiny_model_dir, port: int = 0):
        fresh = [start_engine(model_dir, tmp_path / f"engine{len(started) + n}.log", port)
                 for n in range(num)]
        started.extend(fresh)
        return fresh

    yield launch
    for engine in started:
        engine.kill()


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    from undertow.learner.modeldir import init_model_dir

    return init_model_dir(tmp_path_factory.mktemp("models") / "tiny-seed1", size="tiny", seed=1)


@contextlib.asynccontextmanager
async def running_pool(urls, **config):
    router = RouterConfig(**config.pop("router", {}))
    pool = EnginePool(urls, PoolConfig(router=router, health_interval_s=0.2, **config),
                      metrics=GatewayMetrics.create())
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def collect(stream) -> list[GenerationChunk]:
    return [chunk async for chunk in stream]


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def versions_of(chunks):
    return [v for c in chunks for v in c.weight_versions]


async def direct_greedy(pool, engine_id, input_ids, num_tokens, rid):
    """An uninterrupted greedy run on one engine, bypassing routing."""
    request = GenerateRequest(input_ids=tuple(input_ids), rid=rid, sampling_params=SamplingParams(
        max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    result = await pool.engine(engine_id).driver.generate(request)
    return result.output_ids


def check_chunks(chunks, num_tokens):
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.weight_versions) for c in chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason["type"] == "length"
    assert len(tokens_of(chunks)) == num_tokens


async def test_sessions_stick_and_new_sessions_spread(engines):
    urls = [e.url for e in engines(2)]
    async with running_pool(urls) as pool:
        first = await collect(generate(pool, "s1", PROMPT, greedy(4), "r1"))
        home = pool.router.pinned("s1")
        await collect(generate(pool, "s1", PROMPT + tokens_of(first) + [9],
                                    greedy(4), "r2"))
        await collect(generate(pool, "s2", [8, 8, 8], greedy(4), "r3"))
        assert pool.router.pinned("s1") == home
        assert pool.router.pinned("s2") not in (None, home)
        counts = {e.engine_id: pool.metrics.engine_generations.value(engine=e.engine_id)
                  for e in pool.engines}
        assert counts[home] == 2 and sum(counts.values()) == 3
        await pool.close_session("s1")
        assert pool.router.pinned("s1") is None


async def test_admission_without_a_wait_refuses_past_the_limit(engines):
    urls = [e.url for e in engines(2)]
    async with running_pool(urls, router={"max_in_flight_per_engine": 1, "retry_after_s": 2.5,
                                          "admission_wait_s": 0}) as pool:
        params = greedy(30)
        streams = [generate(pool, f"s{n}", PROMPT, params, f"r{n}") for n in range(2)]
        firsts = [await anext(stream) for stream in streams]
        with pytest.raises(PoolBusy) as refused:
            await anext(generate(pool, "s9", PROMPT, params, "r9"))
        assert refused.value.retry_after_s == 2.5
        assert pool.metrics.admission_refusals.value() == 1
        rests = [await collect(stream) for stream in streams]
        for first, rest in zip(firsts, rests, strict=True):
            check_chunks([first, *rest], 30)
        assert len(tokens_of(await collect(generate(pool, "s9", PROMPT, params, "r9b")))) == 30


async def test_engine_killed_mid_stream_resumes_exactly_elsewhere(engines):
    victim, survivor = engines(2)
    async with running_pool([victim.url, survivor.url]) as pool:
        victim_id, survivor_id = (e.engine_id for e in pool.engines)
        expected = await direct_greedy(pool, survivor_id, PROMPT, 60, "reference")
        pool.router.assign("s1", victim_id, PROMPT)
        stream = generate(pool, "s1", PROMPT, greedy(60), "r1")
        chunks = [await anext(stream)]
        while len(tokens_of(chunks)) < 3:
            chunks.append(await anext(stream))
        victim.kill()
        chunks += await collect(stream)
        check_chunks(chunks, 60)
        assert tokens_of(chunks) == expected
        assert pool.metrics.resumes.value(cause="engine_died") == 1
        assert pool.engine(victim_id).state is EngineState.DEAD
        assert pool.router.pinned("s1") == survivor_id
        assert not pool.engine(survivor_id).attempts


async def test_dead_engine_returns_with_the_pools_weights(engines, other_model_dir):
    (engine,) = engines(1)
    port = int(engine.url.rsplit(":", 1)[1])
    async with running_pool([engine.url]) as pool:
        await pool.update_weights(str(other_model_dir), 4)
        engine.kill()
        with pytest.raises(PoolUnavailable):
            await collect(generate(pool, "s1", PROMPT, greedy(2), "r1"))
        assert pool.engines[0].state is EngineState.DEAD
        engines(1, port=port)  # restarted from the original weights, version 0
        for _ in range(300):
            if pool.engines[0].state is EngineState.HEALTHY:
                break
            await asyncio.sleep(0.1)
        chunks = await collect(generate(pool, "s1", PROMPT, greedy(2), "r2"))
        assert versions_of(chunks) == [4, 4]


async def test_drain_pause_past_its_timeout_aborts_and_resumes(engines):
    (engine,) = engines(1)
    async with running_pool([engine.url], drain_timeout_s=0.05) as pool:
        stream = generate(pool, "s1", PROMPT, greedy(60), "r1")
        chunks = [await anext(stream)]
        await pool.pause("drain")
        assert not pool.engines[0].attempts
        await pool.resume()
        chunks += await collect(stream)
        check_chunks(chunks, 60)
        assert pool.metrics.resumes.value(cause="pause") == 1


async def test_abort_resume_update_keeps_one_stream_with_versions(engines, other_model_dir):
    (engine,) = engines(1)
    async with running_pool([engine.url]) as pool:
        (engine_id,) = (e.engine_id for e in pool.engines)
        stream = generate(pool, "s1", PROMPT, greedy(60), "r1")
        chunks = [await anext(stream)]
        while len(tokens_of(chunks)) < 3:
            chunks.append(await anext(stream))
        update = asyncio.create_task(
            pool.update_weights(str(other_model_dir), 1, mode="abort_resume"))
        chunks += await collect(stream)
        result = await update
        assert result["failed"] == {} and result["updated"] == [engine_id]
        check_chunks(chunks, 60)
        versions = versions_of(chunks)
        num_old = versions.count(0)
        assert 3 <= num_old < 60 and versions == [0] * num_old + [1] * (60 - num_old)
        assert pool.metrics.resumes.value(cause="pause") == 1
        tokens = tokens_of(chunks)
        after = await direct_greedy(pool, engine_id, PROMPT + tokens[:num_old], 60 - num_old,
                                    "reference")
        assert tokens[num_old:] == after


async def test_drain_pause_lets_in_flight_finish_on_old_weights(engines, other_model_dir):
    (engine,) = engines(1)
    async with running_pool([engine.url]) as pool:
        stream = generate(pool, "s1", PROMPT, greedy(40), "r1")
        chunks = [await anext(stream)]
        update = asyncio.create_task(pool.update_weights(str(other_model_dir), 7, mode="drain"))
        while not pool.paused:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(
            collect(generate(pool, "s2", PROMPT, greedy(5), "r2")))
        chunks += await collect(stream)
        await update
        later = await waiting
        check_chunks(chunks, 40)
        assert set(versions_of(chunks)) == {0}
        assert versions_of(later) == [7] * 5
        assert pool.metrics.resumes.value(cause="pause") == 0


async def test_draining_an_engine_moves_its_sessions(engines):
    urls = [e.url for e in engines(2)]
    async with running_pool(urls) as pool:
        first, second = (e.engine_id for e in pool.engines)
        params = greedy(30)
        for session in ("s1", "s2"):
            pool.router.assign(session, first, PROMPT)
        streams = [generate(pool, session, PROMPT, params, f"r-{session}")
                   for session in ("s1", "s2")]
        heads = [await anext(stream) for stream in streams]
        await pool.drain_engine(first)
        assert pool.engine(first).state is EngineState.DRAINING
        assert pool.router.sessions_on(first) == []
        for head, stream in zip(heads, streams, strict=True):
            check_chunks([head, *await collect(stream)], 30)
        assert pool.metrics.engine_generations.value(engine=second) == 0
        assert pool.metrics.resumes.value(cause="migrate") == 0
        for session in ("s1", "s2"):
            await collect(generate(pool, session, PROMPT, greedy(2),
                                        f"next-{session}"))
            assert pool.router.pinned(session) == second
        assert pool.metrics.engine_generations.value(engine=first) == 2


async def test_drain_with_migrate_resumes_in_flight_exactly(engines):
    urls = [e.url for e in engines(2)]
    async with running_pool(urls) as pool:
        first, second = (e.engine_id for e in pool.engines)
        expected = await direct_greedy(pool, second, PROMPT, 50, "reference")
        pool.router.assign("s1", first, PROMPT)
        stream = generate(pool, "s1", PROMPT, greedy(50), "r1")
        chunks = [await anext(stream)]
        await pool.drain_engine(first, migrate=True)
        chunks += await collect(stream)
        check_chunks(chunks, 50)
        assert tokens_of(chunks) == expected
        assert pool.metrics.resumes.value(cause="migrate") == 1
        assert pool.router.pinned("s1") == second


async def test_engines_added_and_removed_at_run_time(engines, tiny_model_dir):
    (one,) = engines(1)
    async with running_pool([one.url]) as pool:
        (first,) = (e.engine_id for e in pool.engines)
        await collect(generate(pool, "s1", PROMPT, greedy(2), "r1"))
        (two,) = engines(1)
        await pool.update_weights(str(tiny_model_dir), 2)
        added = await pool.add_engine(two.url)
        assert added.weight_version == "2"
        await collect(generate(pool, "s2", [1, 2, 3], greedy(2), "r2"))
        assert pool.router.pinned("s2") == added.engine_id
        await pool.remove_engine(first)
        assert [e.engine_id for e in pool.engines] == [added.engine_id]
        await collect(generate(pool, "s1", PROMPT, greedy(2), "r3"))
        assert pool.router.pinned("s1") == added.engine_id
        with pytest.raises(UnknownEngine):
            await pool.drain_engine(first)
        with pytest.raises(PoolUnavailable):
            await pool.add_engine(one.url.rsplit(":", 1)[0] + ":1")


async def test_weights_pushed_with_no_live_engine_go_to_engines_added_later(engines,
                                                                             other_model_dir):
    async with running_pool([]) as pool:
        result = await pool.update_weights(str(other_model_dir), 3)
        assert result["failed"] == {} and result["updated"] == []
        assert result["pool_weights"] == {"model_path": str(other_model_dir),
                                          "weight_version": "3"}
        (engine,) = engines(1)  # started from the original weights, version 0
        added = await pool.add_engine(engine.url)
        assert added.weight_version == "3"
        chunks = await collect(generate(pool, "s1", PROMPT, greedy(2), "r"))
        assert versions_of(chunks) == [3, 3]


async def test_consumer_leaving_mid_stream_aborts_on_the_engine(engines):
    (engine,) = engines(1)
    async with running_pool([engine.url]) as pool:
        stream = generate(pool, "s1", PROMPT, greedy(400), "r1")
        await anext(stream)
        await stream.aclose()
        assert not pool.engines[0].attempts
        driver = pool.engines[0].driver
        for _ in range(100):
            if (await driver.server_info())["num_running_reqs"] == 0:
                break
            await asyncio.sleep(0.05)
        assert (await driver.server_info())["num_running_reqs"] == 0
        assert pool.metrics.engine_in_flight.value(engine=pool.engines[0].engine_id) == 0


async def test_finished_generation_is_not_aborted():
    """The engine ends its stream (`[DONE]`) a little after its finishing piece: the
    consumer has every chunk and nothing counts as in flight before then, and the
    finished request is never aborted (which would also cost its connection)."""
    engine = ScriptedEngine(default=[11, 12, 13], end_delay_s=0.05)
    paths: list[str] = []
    num_replies_done = 0

    @web.middleware
    async def record(request: web.Request, handler):
        nonlocal num_replies_done
        paths.append(request.path)
        try:
            return await handler(request)
        finally:
            num_replies_done += request.path == "/generate"

    app = engine.app()
    app.middlewares.append(record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    num_calls = 3
    try:
        async with running_pool([f"http://127.0.0.1:{runner.addresses[0][1]}"]) as pool:
            for n in range(num_calls):
                chunks = await collect(generate(
                    pool, f"s{n}", PROMPT, SamplingParams(max_new_tokens=8), f"r{n}"))
                assert tokens_of(chunks) == [11, 12, 13]
                assert chunks[-1].finish_reason["type"] == "stop"
                assert not pool.engines[0].attempts
            while num_replies_done < num_calls:  # the streams' ends, read in the background
                await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert paths.count("/generate") == num_calls
    assert "/abort_request" not in paths


@contextlib.asynccontextmanager
async def scripted_pool(engine: ScriptedEngine):
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with running_pool([f"http://127.0.0.1:{runner.addresses[0][1]}"]) as pool:
            yield pool
    finally:
        await runner.cleanup()


async def test_chunks_hold_what_came_since_the_consumer_last_took_them():
    """One engine event per token. Not live, the consumer is woken once, with every token;
    live, a consumer that reads only after the engine is done gets what came meanwhile in
    one chunk, not one per event: the same tokens, logprobs and versions either way."""
    script = list(range(100, 140))
    engine = ScriptedEngine(default=script, stop_token_ids=(139,))
    async with scripted_pool(engine) as pool:
        params = SamplingParams(max_new_tokens=64)
        every = await collect(generate(pool, "s0", PROMPT, params, "r0"))
        whole = await collect(generate(pool, "s1", PROMPT, params, "r1", live=False))
        late = generate(pool, "s2", PROMPT, params, "r2")
        first = await anext(late)
        while engine.streaming:  # the engine writes the rest before the consumer reads on
            await asyncio.sleep(0.01)
        late_chunks = [first, *await collect(late)]
    assert len(whole) == 1 and tokens_of(whole) == script
    assert len(late_chunks) <= 3  # 40 events
    for chunks, rid in ((every, "r0"), (whole, "r1"), (late_chunks, "r2")):
        check_chunks_stop(chunks, script)
        assert [lp for c in chunks for lp in c.logprobs] == engine.sent[rid].logprobs
        assert versions_of(chunks) == [7] * len(script)
        assert all(c.received_s > 0 for c in chunks)


def check_chunks_stop(chunks, token_ids):
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.weight_versions) for c in chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason["type"] == "stop"
    assert tokens_of(chunks) == token_ids


async def test_failed_weight_update_drains_the_engine(engines, tmp_path):
    (engine,) = engines(1)
    async with running_pool([engine.url]) as pool:
        result = await pool.update_weights(str(tmp_path / "missing"), 5)
        (engine_id,) = result["failed"]
        assert result["updated"] == [] and pool.fleet.weights is None
        assert result["pool_weights"] is None
        assert pool.engine(engine_id).state is EngineState.DRAINING
        assert (await pool.add_engine(engine.url)).state is EngineState.HEALTHY
        chunks = await collect(generate(pool, "s1", PROMPT, greedy(2), "r"))
        assert versions_of(chunks) == [0, 0]


async def test_no_engine_means_unavailable():
    async with running_pool([]) as pool:
        with pytest.raises(PoolUnavailable):
            await collect(generate(pool, "s1", PROMPT, SamplingParams(max_new_tokens=2), "r1"))


async def test_a_config_replaced_on_a_running_pool_reaches_its_parts():
    """`pool.config` may be replaced on a running pool (test_migration turns KV transfer
    off so); admission, the in-flight generations and pauses follow the new one."""
    async with running_pool([]) as pool:
        pool.config = dataclasses.replace(
            pool.config, resume_timeout_s=3.0, drain_timeout_s=4.0, health_timeout_s=5.0,
            abort_retry_interval_s=0.5, migration=MigrationConfig(kv_transfer=False))
        assert pool.admission.resume_timeout_s == 3.0
        assert pool.weight_updates.drain_timeout_s == 4.0
        assert pool.inflight.config == InFlightConfig(5.0, 0.5, MigrationConfig(False))


@contextlib.asynccontextmanager
async def admin_server(pool, token="secret"):
    def admin_auth(request):
        if request.headers.get("Authorization") != f"Bearer {token}":
            raise web.HTTPUnauthorized(text="admin token missing or wrong")

    app = web.Application()
    add_engine_routes(app, pool, admin_auth)

    async def metrics_page(request):
        return web.Response(body=pool.metrics.registry.render().encode(),
                            headers={"Content-Type": pool.metrics.registry.CONTENT_TYPE})

    app.router.add_get("/metrics", metrics_page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}",
                                     headers={"Authorization": f"Bearer {token}"}) as http:
        try:
            yield http
        finally:
            await runner.cleanup()


def metric_value(text, name, **labels):
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


async def test_operator_routes_and_metrics(engines, other_model_dir):
    one, two = engines(2)
    async with running_pool([one.url]) as pool, admin_server(pool) as http:
        async with http.get("/admin/engines", headers={"Authorization": "Bearer nope"}) as reply:
            assert reply.status == 401
        async with http.post("/admin/engines", json={"url": two.url}) as reply:
            assert reply.status == 201
            added = (await reply.json())["id"]
        async with http.post("/admin/engines", json={"url": "not a url"}) as reply:
            assert reply.status == 400
        await collect(generate(pool, "s1", PROMPT, greedy(3), "r1"))
        async with http.get("/admin/engines") as reply:
            listed = await reply.json()
        assert [e["state"] for e in listed["engines"]] == ["healthy", "healthy"]
        async with http.post("/admin/pause", json={"mode": "sideways"}) as reply:
            assert reply.status == 400
        async with http.post("/admin/pause", json={"mode": "drain"}) as reply:
            assert (await reply.json())["paused"] is True
        async with http.post("/admin/resume") as reply:
            assert (await reply.json())["paused"] is False
        async with http.post("/admin/update_weights", json={
                "model_path": str(other_model_dir), "weight_version": 3}) as reply:
            assert reply.status == 200 and (await reply.json())["failed"] == {}
        chunks = await collect(generate(pool, "s2", PROMPT, greedy(3), "r2"))
        assert versions_of(chunks) == [3, 3, 3]
        async with http.post(f"/admin/engines/{added}/drain", json={}) as reply:
            assert (await reply.json())["state"] == "draining"
        async with http.post("/admin/engines/e99/drain", json={}) as reply:
            assert reply.status == 404
        async with http.get("/metrics") as reply:
            text = await reply.text()
        assert metric_value(text, "undertow_engine_state", engine=added, state="draining") == 1
        generations = [metric_value(text, "undertow_engine_generations_total", engine=e["id"])
                       for e in listed["engines"]]
        assert sum(value or 0 for value in generations) == 2
        async with http.delete(f"/admin/engines/{added}") as reply:
            assert (await reply.json())["removed"] == added
        async with http.get("/metrics") as reply:
            text = await reply.text()
        assert metric_value(text, "undertow_engine_state", engine=added, state="draining") is None
        assert len(pool.engines) == 1
