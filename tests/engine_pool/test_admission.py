"""Admission that waits: calls that find every engine at its bound queue, fairly, and get a
429 only past `router.admission_wait_s`.

Through the real `openai` SDK (retries off) against the gateway in front of a scripted
engine with one more fault switch, `HeldEngine`: every generation waits before its reply
until the test releases it. With `max_in_flight_per_engine=1` the engine holds one
generation at a time, so the order generations reach it is the order the pool admitted
them; the expected orders are written out by hand from the rule in
`gateway/engine_pool/admission_queue.py` (round-robin over groups, then sessions; the lanes of
later and first calls taken in turn). The pool-level tests check that an added engine, a
drain, an engine's death, a pause and the pool's close wake or fail the waiters."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass, field

import openai
import pytest
from aiohttp import web

from tests.gateway.scripted_engine import ScriptedEngine
from tests.gateway.test_disconnects import until
from undertow.gateway.engine_pool.pool import EnginePool, PoolConfig, PoolUnavailable
from undertow.gateway.engine_pool.router import RouterConfig
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.front.app import METRICS_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")
LABEL = re.compile(r"call ([A-Z]\d+) now")


@dataclass
class HeldEngine(ScriptedEngine):
    """The scripted engine, holding every `/generate` before its reply until `release`
    lets one go; `arrived` lists each generation's prompt IDs in the order they came."""

    arrived: list[list[int]] = field(default_factory=list)
    released: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    broken: bool = False  # a released generation is answered 500, as by a dying engine

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.arrived.append((await request.json())["input_ids"])
        await self.released.acquire()
        if self.broken:
            return web.Response(status=500, text="the engine broke")
        return await super().generate(request)

    def release(self, num: int = 1) -> None:
        for _ in range(num):
            self.released.release()


@pytest.fixture
async def held(renderer):
    engines, runners = [], []

    async def start() -> HeldEngine:
        engine = HeldEngine(default=renderer.encode("Done.") + [2], stop_token_ids=(2,))
        runner = web.AppRunner(engine.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        engines.append(engine)
        runners.append(runner)
        return engine

    yield start
    for engine in engines:
        engine.release(1000)
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def caller(clients):
    """`caller(session, label, **client_options)`: a task running one chat call whose
    prompt names `label`, through the openai SDK with retries off."""
    tasks: list[asyncio.Task] = []

    def call(session: dict, label: str, stream: bool = False, **options) -> asyncio.Task:
        client = clients("openai", base_url=session["base_url"], api_key=session["api_key"],
                         max_retries=0, **options)
        messages = [{"role": "user", "content": f"call {label} now"}]

        async def run():
            reply = await client.chat.completions.create(model="m", messages=messages,
                                                         max_tokens=8, stream=stream)
            if stream:
                return "".join([chunk.choices[0].delta.content or "" async for chunk in reply
                                if chunk.choices])
            return reply.choices[0].message.content

        task = asyncio.create_task(run())
        tasks.append(task)
        return task

    yield call
    for task in tasks:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


@pytest.fixture
async def clients():
    made = []

    def make(kind, **kwargs):
        client = openai.AsyncOpenAI(**kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


def labels(engine: HeldEngine, renderer) -> list[str]:
    return [LABEL.findall(renderer.decode(ids))[-1] for ids in engine.arrived]


async def one_slot_gateway(make_gateway, engine: HeldEngine, wait_s: float = 60.0,
                           retry_after_s: float = 1.0):
    return await make_gateway([engine.url], router=RouterConfig(
        max_in_flight_per_engine=1, admission_wait_s=wait_s, retry_after_s=retry_after_s))


def waiting(gateway) -> float:
    return gateway.app[METRICS_KEY].admission_waiting.value()


async def admit_in_turn(engine: HeldEngine, num: int) -> None:
    """Lets the held generation go, and each of the next `num` once it has arrived."""
    for _ in range(num):
        num_arrived = len(engine.arrived)
        engine.release()
        await until(lambda n=num_arrived: len(engine.arrived) > n, "the next admitted call")
    engine.release()


async def test_a_burst_of_one_group_does_not_delay_another_groups_first_call(
        make_gateway, held, caller, renderer):
    engine = await held()
    gateway = await one_slot_gateway(make_gateway, engine)
    holder = caller(await gateway.open_session("hold"), "H0")
    await until(lambda: len(engine.arrived) == 1, "the holder on the engine")
    burst = [caller(await gateway.open_session("a"), f"A{n}") for n in range(5)]
    await until(lambda: waiting(gateway) == 5, "group a's burst queued")
    first = caller(await gateway.open_session("b"), "B0")
    await until(lambda: waiting(gateway) == 6, "group b's first call queued")
    await admit_in_turn(engine, 6)
    replies = await asyncio.gather(holder, *burst, first)
    assert replies == ["Done."] * 7
    assert labels(engine, renderer) == ["H0", "A0", "B0", "A1", "A2", "A3", "A4"]
    assert waiting(gateway) == 0


async def test_a_sessions_later_call_does_not_wait_behind_new_sessions(
        make_gateway, held, caller, renderer):
    engine = await held()
    gateway = await one_slot_gateway(make_gateway, engine)
    started = {name: await gateway.open_session("c") for name in "ST"}
    for name, session in started.items():  # each session's first call, answered
        num_arrived = len(engine.arrived)
        task = caller(session, f"{name}1")
        await until(lambda n=num_arrived: len(engine.arrived) > n, "a first call")
        engine.release()
        assert await task == "Done."
    holder = caller(await gateway.open_session("hold"), "H0")
    await until(lambda: len(engine.arrived) == 3, "the holder on the engine")
    flood = [caller(await gateway.open_session("d"), f"D{n}") for n in range(3)]
    await until(lambda: waiting(gateway) == 3, "the new sessions queued")
    later = [caller(started["S"], "S2"), caller(started["T"], "T2")]
    await until(lambda: waiting(gateway) == 5, "the later calls queued")
    await admit_in_turn(engine, 5)
    assert await asyncio.gather(holder, *flood, *later) == ["Done."] * 6
    assert labels(engine, renderer) == ["S1", "T1", "H0", "S2", "D0", "T2", "D1", "D2"]


async def test_a_waiting_call_is_refused_only_past_its_wait(make_gateway, held, caller):
    engine = await held()
    gateway = await one_slot_gateway(make_gateway, engine, wait_s=2.0, retry_after_s=3.0)
    holder = caller(await gateway.open_session("hold"), "H0")
    await until(lambda: len(engine.arrived) == 1, "the holder on the engine")
    started_s = time.monotonic()
    with pytest.raises(openai.RateLimitError) as refused:
        await caller(await gateway.open_session("w"), "W0")
    assert time.monotonic() - started_s >= 2.0  # the bound, never earlier
    assert refused.value.response.headers["retry-after"] == "3"
    assert "admission_wait_s" in refused.value.message
    metrics = gateway.app[METRICS_KEY]
    assert metrics.admission_refusals.value() == 1
    assert metrics.admission_wait_s.count(outcome="refused") == 1
    engine.release()
    assert await holder == "Done."


@pytest.mark.parametrize("stream", [False, True])
async def test_a_waiting_call_whose_client_leaves_leaves_the_queue(
        make_gateway, held, caller, renderer, stream):
    engine = await held()
    gateway = await one_slot_gateway(make_gateway, engine)
    holder = caller(await gateway.open_session("hold"), "H0")
    await until(lambda: len(engine.arrived) == 1, "the holder on the engine")
    with pytest.raises(openai.APITimeoutError):
        await caller(await gateway.open_session("w"), "W0", stream=stream, timeout=1.0)
    await until(lambda: waiting(gateway) == 0, "the waiting call gone, the slot still held")
    metrics = gateway.app[METRICS_KEY]
    await until(lambda: metrics.admission_wait_s.count(outcome="left") == 1, "counted as left")
    assert metrics.client_disconnects.value(api="chat") == 1
    engine.release(2)
    assert await holder == "Done."
    assert await caller(await gateway.open_session("x"), "X0") == "Done."
    assert labels(engine, renderer) == ["H0", "X0"]  # the one that left never reached it


@contextlib.asynccontextmanager
async def one_slot_pool(*urls: str, wait_s: float = 60.0):
    pool = EnginePool(urls, PoolConfig(router=RouterConfig(max_in_flight_per_engine=1,
                                                           admission_wait_s=wait_s),
                                       health_interval_s=0.2))
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


def generation(pool: EnginePool, name: str) -> asyncio.Task:
    async def run() -> list[int]:
        stream = pool.generate(name, GenerateRequest(input_ids=[5, 6, 7], rid=f"r-{name}",
                                                     sampling_params=SamplingParams(
                                                         max_new_tokens=4)))
        return [t async for chunk in stream for t in chunk.token_ids]
    return asyncio.create_task(run())


async def test_waiting_generations_get_an_added_engines_slot(held):
    first, second = await held(), await held()
    async with one_slot_pool(first.url) as pool:
        running = generation(pool, "s1")
        await until(lambda: len(first.arrived) == 1, "s1 on the first engine")
        waiter = generation(pool, "s2")
        await until(lambda: pool.metrics.admission_waiting.value() == 1, "s2 queued")
        await pool.add_engine(second.url)
        await until(lambda: len(second.arrived) == 1, "s2 on the added engine")
        first.release()
        second.release()
        assert await running == first.sent["r-s1"].output_ids
        assert await waiter == second.sent["r-s2"].output_ids


async def test_a_drain_moves_waiters_to_the_other_engine_or_fails_them(held):
    first, second = await held(), await held()
    async with one_slot_pool(first.url, second.url) as pool:
        running = [generation(pool, f"s{n}") for n in range(2)]
        await until(lambda: len(first.arrived) == len(second.arrived) == 1, "both engines busy")
        waiters = [generation(pool, f"w{n}") for n in range(2)]
        await until(lambda: pool.metrics.admission_waiting.value() == 2, "two queued")
        await pool.drain_engine("e0")
        assert pool.metrics.admission_waiting.value() == 2  # e1 is healthy: they wait on
        first.release()
        second.release()
        await until(lambda: len(second.arrived) == 2, "w0 on the engine left")
        assert len(first.arrived) == 1  # the drained engine got no waiter
        await pool.drain_engine("e1")  # no healthy engine left: the last waiter fails
        with pytest.raises(PoolUnavailable, match="no healthy engine"):
            await waiters[1]
        second.release()
        assert await waiters[0] == second.sent["r-w0"].output_ids
        assert await asyncio.gather(*running) == [first.sent["r-s0"].output_ids,
                                                  second.sent["r-s1"].output_ids]


async def test_waiting_generations_fail_when_their_only_engine_dies(held):
    engine = await held()
    async with one_slot_pool(engine.url) as pool:
        running = generation(pool, "s1")
        await until(lambda: len(engine.arrived) == 1, "s1 on the engine")
        waiters = [generation(pool, f"w{n}") for n in range(3)]
        await until(lambda: pool.metrics.admission_waiting.value() == 3, "three queued")
        engine.broken = True
        engine.release(10)
        for task in [running, *waiters]:
            with pytest.raises(PoolUnavailable, match="no healthy engine"):
                await task
        assert pool.metrics.admission_waiting.value() == 0
        assert pool.metrics.admission_refusals.value() == 0


async def test_a_pause_keeps_waiters_past_their_bound_and_a_close_fails_them(held):
    engine = await held()
    async with one_slot_pool(engine.url, wait_s=0.2) as pool:
        await pool.pause("drain")
        waiters = [generation(pool, f"s{n}") for n in range(2)]
        await until(lambda: pool.metrics.admission_waiting.value() == 2, "both queued")
        await asyncio.sleep(0.5)  # past their bound, paused: never refused for a pause
        assert pool.metrics.admission_waiting.value() == 2
        assert pool.metrics.admission_refusals.value() == 0
    for waiter in waiters:
        with pytest.raises(PoolUnavailable, match="shutting down"):
            await waiter
    assert engine.arrived == []
