"""`SGLangDriver` against a scripted SGLang-like server: the wire forms it must read (cumulative
and incremental streams, long events) and the faults it must name (4xx with the engine's
message, 5xx, a refused connection, a stream that breaks off)."""

import json
import socket

import pytest
from aiohttp import web

from undertow.gateway.engines.drivers import DRIVERS
from undertow.gateway.engines.protocol import (
    EngineDriver,
    EngineRejected,
    EngineUnavailable,
    GenerateRequest,
    KVTransfer,
    SamplingParams,
    kv_transfer_of,
    result_from_chunks,
)
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.engines.sglang_replies import latest_events

pytestmark = pytest.mark.asyncio(loop_scope="session")

REQUEST = GenerateRequest(input_ids=(1, 2, 3), rid="r1", return_logprob=True)


def event(output_ids, text, logprobs, finish=None) -> bytes:
    meta = {"id": "r1", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": 0,
            "cached_tokens": 0, "weight_version": "7",
            "output_token_logprobs": [[lp, t, None] for lp, t in logprobs]}
    return b"data: " + json.dumps({"text": text, "output_ids": output_ids,
                                   "meta_info": meta}).encode() + b"\n\n"


def cumulative_stream() -> list[bytes]:
    ids, texts, logprobs = [5, 6, 7], ["a", "b", "c"], [(-0.5, 5), (-1.0, 6), (-1.5, 7)]
    events = []
    for n in range(1, 4):
        finish = {"type": "length", "length": 3} if n == 3 else None
        chunk = event(ids[:n], "".join(texts[:n]), logprobs[:n], finish)
        events.append(chunk.replace(b'"completion_tokens": 0', f'"completion_tokens": {n}'
                                    .encode()))
    return [*events, b"data: [DONE]\n\n"]


def incremental_stream() -> list[bytes]:
    events = []
    for n, (token_id, text, logprob) in enumerate([(5, "a", -0.5), (6, "b", -1.0),
                                                   (7, "c", -1.5)], start=1):
        finish = {"type": "length", "length": 3} if n == 3 else None
        chunk = event([token_id], text, [(logprob, token_id)], finish)
        events.append(chunk.replace(b'"completion_tokens": 0', f'"completion_tokens": {n}'
                                    .encode()))
    return [*events, b"data: [DONE]\n\n"]


@pytest.fixture
async def scripted_engine():
    """A server whose `/generate` replays `script["events"]` or answers `script["status"]`."""
    script = {"events": [], "status": 200, "body": {}}

    async def generate(request: web.Request) -> web.StreamResponse:
        if script["status"] != 200:
            return web.json_response(script["body"], status=script["status"])
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        for piece in script["events"]:
            await reply.write(piece)
        if script.get("drop"):
            request.transport.close()
            return reply
        await reply.write_eof()
        return reply

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    async with SGLangDriver(f"http://127.0.0.1:{port}") as driver:
        yield driver, script
    await runner.cleanup()


@pytest.mark.parametrize("events", [cumulative_stream(), incremental_stream()],
                         ids=["cumulative", "incremental"])
async def test_streams_become_deltas_in_either_form(scripted_engine, events):
    driver, script = scripted_engine
    script["events"] = events
    chunks = [chunk async for chunk in driver.generate_stream(REQUEST)]
    assert [token_id for chunk in chunks for token_id in chunk.output_ids] == [5, 6, 7]
    assert "".join(chunk.text for chunk in chunks) == "abc"
    result = result_from_chunks(chunks)
    assert result.output_token_logprobs == [(-0.5, 5), (-1.0, 6), (-1.5, 7)]
    assert result.finish_reason.type == "length"
    assert result.weight_version == "7"


def long_stream(num_tokens: int, cumulative: bool) -> list[bytes]:
    events = []
    for n in range(1, num_tokens + 1):
        finish = {"type": "length", "length": num_tokens} if n == num_tokens else None
        first = 0 if cumulative else n - 1
        chunk = event(list(range(first, n)), "".join(f"<{i}>" for i in range(first, n)),
                      [(-0.01 * i, i) for i in range(first, n)], finish)
        events.append(chunk.replace(b'"completion_tokens": 0', f'"completion_tokens": {n}'
                                    .encode()))
    return [*events, b"data: [DONE]\n\n"]


@pytest.mark.parametrize("cumulative", [True, False], ids=["cumulative", "incremental"])
async def test_cumulative_events_read_together_become_one_delta(scripted_engine, cumulative):
    """A fast engine's 100 events reach the driver in one write: in the cumulative form
    each holds all the ones before it, so the driver reads the latest of each read (one
    delta through the pool, not a hundred); incremental events are each a delta."""
    driver, script = scripted_engine
    script["events"] = [b"".join(long_stream(100, cumulative))]
    chunks = [chunk async for chunk in driver.generate_stream(REQUEST)]
    result = result_from_chunks(chunks)
    assert result.output_ids == list(range(100))
    assert result.output_token_logprobs == [(-0.01 * i, i) for i in range(100)]
    assert result.text == "".join(f"<{i}>" for i in range(100))
    if cumulative:
        assert len(chunks) <= 3, len(chunks)  # one per read of the connection
    else:
        assert len(chunks) == 100


async def test_an_event_is_skipped_only_when_the_next_one_holds_it():
    def cumulative(num: int, version: str = "7", finish=None) -> dict:
        return {"output_ids": list(range(num)), "text": "x" * num, "meta_info": {
            "completion_tokens": num, "weight_version": version, "finish_reason": finish,
            "output_token_logprobs": [[-1.0, i, None] for i in range(num)]}}

    events = [cumulative(1), cumulative(2), cumulative(3, "8"), cumulative(4, "8")]
    assert latest_events(events) == events[1:2] + events[3:]  # new weights: kept apart
    finished = [cumulative(2, finish={"type": "abort"}), cumulative(3)]
    assert latest_events(finished) == finished
    incremental = [cumulative(1), {**cumulative(1), "meta_info": {
        **cumulative(1)["meta_info"], "completion_tokens": 2}}]
    assert latest_events(incremental) == incremental


async def test_an_event_longer_than_a_line_buffer_is_read_whole(scripted_engine):
    driver, script = scripted_engine
    ids = list(range(30_000))
    script["events"] = [event(ids, "x" * 100_000, [], {"type": "length"}),
                        b"data: [DONE]\n\n"]
    chunks = [chunk async for chunk in driver.generate_stream(REQUEST)]
    assert chunks[0].output_ids == ids and len(chunks[0].text) == 100_000


async def test_a_4xx_raises_rejected_with_the_engines_message(scripted_engine):
    driver, script = scripted_engine
    script.update(status=400, body={"error": {"message": "input_ids is empty"}})
    with pytest.raises(EngineRejected) as error:
        await driver.generate(REQUEST)
    assert error.value.message == "input_ids is empty"
    assert error.value.status == 400


async def test_an_error_event_in_a_stream_raises_rejected(scripted_engine):
    driver, script = scripted_engine
    script["events"] = [b'data: {"error": {"message": "prompt too long"}}\n\n',
                        b"data: [DONE]\n\n"]
    with pytest.raises(EngineRejected, match="prompt too long"):
        [chunk async for chunk in driver.generate_stream(REQUEST)]


async def test_a_5xx_raises_unavailable(scripted_engine):
    driver, script = scripted_engine
    script.update(status=503, body={})
    with pytest.raises(EngineUnavailable, match="503"):
        await driver.generate(REQUEST)


async def test_a_stream_that_breaks_off_raises_unavailable(scripted_engine):
    driver, script = scripted_engine
    script.update(events=cumulative_stream()[:1], drop=True)
    chunks = []
    with pytest.raises(EngineUnavailable):
        async for chunk in driver.generate_stream(REQUEST):
            chunks.append(chunk)
    assert [chunk.output_ids for chunk in chunks] == [[5]]


async def test_a_refused_connection_raises_unavailable_and_health_is_false(unused_tcp_port):
    async with SGLangDriver(f"http://127.0.0.1:{unused_tcp_port}") as driver:
        assert not await driver.health()
        with pytest.raises(EngineUnavailable, match="unreachable"):
            await driver.generate(REQUEST)


async def test_every_driver_is_an_engine_driver_and_the_sglang_one_a_kv_transfer():
    """The pool drives every engine through `EngineDriver` and migration moves KV through
    `KVTransfer`, which only the SGLang driver implements; `kv_transfer_of` gives it only
    where the engine has the extension (nothing listens here: None, no error)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for kind, make_driver in DRIVERS.items():
        async with make_driver(url) as driver:
            assert isinstance(driver, EngineDriver), kind
            assert isinstance(driver, KVTransfer) == (kind == "sglang")
            assert await kv_transfer_of(driver) is None


async def test_a_choice_gets_its_bound_and_seed_and_the_call_keeps_its_own():
    call = SamplingParams(max_new_tokens=None, temperature=0.5, stop=("END",), sampling_seed=40)
    choice = call.for_choice(2, 64)
    assert choice == SamplingParams(max_new_tokens=64, temperature=0.5, stop=("END",),
                                    sampling_seed=42)
    assert call.max_new_tokens is None and call.sampling_seed == 40
    unseeded = SamplingParams().for_choice(0, 8)
    assert unseeded.sampling_seed is not None and unseeded.max_new_tokens == 8
    with pytest.raises(TypeError, match="seed"):
        call.evolve(seed=1)
