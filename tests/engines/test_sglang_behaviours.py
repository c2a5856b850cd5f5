"""The nine behaviours of SGLang 0.5.23 that the SGLang driver, launcher and pool once got
wrong (issue #20), one test each, against `sglang_faithful.FaithfulSGLang`, a real server
that answers as SGLang's own code does (its docstring names that code, item by item).

Each test fails on the driver as it was before the fix (verified against a copy of that
commit) and passes now.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from tests.engines.sglang_faithful import FaithfulSGLang, serve_faithful
from tests.gateway.capture import captured
from tests.gateway.conftest import make_gateway, renderer  # noqa: F401 (fixtures)
from undertow.gateway.engine_pool.pool import EnginePool, PoolConfig
from undertow.gateway.engines.protocol import (
    EngineError,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
    WeightsNotUpdated,
    result_from_chunks,
)
from undertow.gateway.engines.sglang import SGLangDriver

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = (11, 12, 13, 14, 15, 16)
LONG = SamplingParams(max_new_tokens=100_000, temperature=1.0)
MESSAGES = [{"role": "user", "content": "Fix the failing test."}]


@contextlib.asynccontextmanager
async def faithful(**switches):
    """A faithful SGLang server and a driver for it."""
    server = FaithfulSGLang(**switches)
    async with serve_faithful(server) as url, SGLangDriver(url) as driver:
        yield server, driver


@contextlib.asynccontextmanager
async def pool_on(url: str):
    pool = EnginePool([url], PoolConfig(health_timeout_s=5.0))
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def until(predicate, step_s: float = 0.01) -> None:
    while not predicate():
        await asyncio.sleep(step_s)


async def consume(generation, into: list) -> None:
    async for chunk in generation:
        into.append(chunk)


def token_ids(chunks: list) -> list[int]:
    return [token_id for chunk in chunks for token_id in chunk.token_ids]


# 1 -------------------------------------------------------------------------------------

async def test_1_a_group_of_eight_with_one_prompt_gets_eight_samples_each_replayable(
        make_gateway, renderer):  # noqa: F811 (the gateway tests' fixtures)
    vocab_size = renderer.tokenizer.get_vocab_size(with_added_tokens=False)
    server = FaithfulSGLang(vocab_size=vocab_size)
    async with serve_faithful(server) as url:
        gateway = await make_gateway([url])
        for _ in range(8):
            session = await gateway.open_session()
            async with gateway.http.post(
                    f"{session['base_url']}/chat/completions",
                    headers={"Authorization": f"Bearer {session['api_key']}"},
                    json={"model": "m", "messages": MESSAGES, "max_tokens": 12}) as reply:
                assert reply.status == 200, await reply.text()
        calls = gateway.tree().calls
        completions = [tuple(captured(gateway.tree(), call.call_id).completion_ids)
                       for call in calls]
        assert len(calls) == 8 and len(set(completions)) == 8
        seeds = [call.meta["sampling"]["sampling_seed"] for call in calls]
        assert len(set(seeds)) == 8
        async with SGLangDriver(url) as driver:  # replay the first call from its record
            sent = server.bodies["/generate"][0]
            replayed = await driver.generate(GenerateRequest(
                input_ids=tuple(sent["input_ids"]), sampling_params=SamplingParams(
                    max_new_tokens=12, sampling_seed=seeds[0])))
        assert tuple(replayed.output_ids) == completions[0]


# 2 -------------------------------------------------------------------------------------

async def test_2_a_resumed_generation_draws_a_fresh_sample():
    params = SamplingParams(max_new_tokens=200, sampling_seed=5)
    async with faithful(step_delay_s=0.002) as (server, driver), pool_on(driver.url) as pool:
        reference = await driver.generate(GenerateRequest(
            input_ids=PROMPT, sampling_params=params))
        chunks: list = []
        task = asyncio.create_task(consume(
            pool.generate("s", GenerateRequest(
                input_ids=PROMPT, sampling_params=params, rid="call-00000000000000a2",
                return_logprob=True)), chunks))
        await until(lambda: len(chunks) >= 5)
        await pool.pause("abort_resume")
        await pool.resume()
        await task
    produced = token_ids(chunks)
    assert len(produced) == 200 and chunks[-1].finish_reason["type"] == "length"
    resumed = server.bodies["/generate"][-1]
    num_before = len(resumed["input_ids"]) - len(PROMPT)
    assert produced[:num_before] == reference.output_ids[:num_before]
    assert resumed["sampling_params"]["sampling_seed"] != 5
    assert produced[num_before:] != reference.output_ids[num_before:]


# 3 -------------------------------------------------------------------------------------

async def test_3_a_late_abort_of_an_interrupted_attempt_spares_its_resume():
    params = SamplingParams(max_new_tokens=300, sampling_seed=9)
    async with (faithful(num_tokenizer_workers=2) as (server, driver),
                pool_on(driver.url) as pool):
        chunks: list = []
        task = asyncio.create_task(consume(
            pool.generate("s", GenerateRequest(
                input_ids=PROMPT, sampling_params=params, rid="call-00000000000000a3",
                return_logprob=True)), chunks))
        await until(lambda: len(chunks) >= 3)
        await pool.pause("abort_resume")
        await pool.resume()
        await until(lambda: len(server.rids) == 2 and server.rids[1] in server.requests)
        await driver.abort(server.rids[0])  # the late repeat of the first attempt's abort
        await task
    assert chunks[-1].finish_reason["type"] == "length"
    assert len(token_ids(chunks)) == 300
    assert not any(a != b and b.startswith(a) for a in server.rids for b in server.rids)


# 4 and 5 -------------------------------------------------------------------------------

async def _abort_while_queued(driver: SGLangDriver, server: FaithfulSGLang,
                              request: GenerateRequest) -> list[GenerateChunk]:
    """Streams `request`; after 3 chunks retracts it into the queue and aborts it there."""
    chunks: list[GenerateChunk] = []
    try:
        async for chunk in driver.generate_stream(request):
            chunks.append(chunk)
            if len(chunks) == 3:
                await driver.pause("retract")
                await driver.abort(request.rid)
    finally:
        await driver.resume()
    return chunks


async def test_4_an_incremental_stream_aborted_in_the_queue_repeats_nothing():
    async with faithful(incremental=True) as (server, driver):
        request = GenerateRequest(input_ids=PROMPT, sampling_params=LONG, return_logprob=True)
        chunks = await _abort_while_queued(driver, server, request)
    result = result_from_chunks(chunks)
    assert result.finish_reason.type == "abort"
    assert len(result.output_ids) == result.completion_tokens >= 3
    assert [token_id for _, token_id in result.output_token_logprobs] == result.output_ids
    assert result.text == FaithfulSGLang.text(result.output_ids)


async def test_5_a_queued_abort_keeps_the_prompt_and_cached_counts():
    async with faithful() as (server, driver):
        await driver.generate(GenerateRequest(input_ids=PROMPT[:4],
                                              sampling_params=SamplingParams(max_new_tokens=2)))
        request = GenerateRequest(input_ids=PROMPT, sampling_params=LONG)
        chunks = await _abort_while_queued(driver, server, request)
        whole = asyncio.create_task(driver.generate(GenerateRequest(
            input_ids=PROMPT, rid="whole", sampling_params=LONG)))
        await until(lambda: "whole" in server.requests
                    and len(server.requests["whole"].output_ids) >= 2)
        await driver.pause("retract")
        await driver.abort("whole")
        await driver.resume()
        result = await whole
    assert chunks[0].cached_tokens == 4
    assert chunks[-1].finish_reason.type == "abort"
    assert (chunks[-1].prompt_tokens, chunks[-1].cached_tokens) == (len(PROMPT), 4)
    assert result.finish_reason.type == "abort" and result.prompt_tokens == len(PROMPT)


# 6 -------------------------------------------------------------------------------------

async def test_6_a_null_logprob_is_an_engine_error():
    async with faithful(null_logprob_at=2) as (_, driver):
        request = GenerateRequest(input_ids=PROMPT, return_logprob=True,
                                  sampling_params=SamplingParams(max_new_tokens=5))
        with pytest.raises(EngineError, match="null"):
            await driver.generate(request)
        with pytest.raises(EngineError, match="null"):
            [chunk async for chunk in driver.generate_stream(request)]


# 7 -------------------------------------------------------------------------------------

async def test_7_health_answers_during_a_pause_and_a_weight_update_without_generating():
    async with faithful() as (server, driver), SGLangDriver(driver.url) as trainer:
        running = asyncio.create_task(driver.generate(GenerateRequest(
            input_ids=PROMPT, rid="running", sampling_params=SamplingParams(
                max_new_tokens=60))))
        await until(lambda: "running" in server.requests)
        update = asyncio.create_task(trainer.update_weights_from_disk("/models/b", "1"))
        await until(lambda: server.updating)
        healthy_during_update = await driver.health()
        await update
        await running
        await driver.pause("in_place")
        healthy_during_pause = await driver.health()
        await driver.resume()
    assert healthy_during_update and healthy_during_pause
    assert server.num_health_generations == 0


# 8 -------------------------------------------------------------------------------------

async def test_8_a_weight_update_during_an_in_place_pause_completes_and_says_so():
    async with faithful() as (server, driver):
        running = asyncio.create_task(driver.generate(GenerateRequest(
            input_ids=PROMPT, rid="running", sampling_params=SamplingParams(
                max_new_tokens=40))))
        await until(lambda: "running" in server.requests
                    and len(server.requests["running"].output_ids) >= 3)
        await driver.pause("in_place")
        await driver.update_weights_from_disk("/models/b", "1")
        info = await driver.model_info()
        still_paused = server.paused is not None
        await driver.resume()
        result = await running
    assert (info.model_path, info.weight_version) == ("/models/b", "1")
    assert still_paused
    assert "/flush_cache" in server.bodies and server.prompts == []  # flushed after loading
    assert result.finish_reason.type == "length" and len(result.output_ids) == 40
    assert result.weight_version == "1"


async def test_8_an_update_whose_flush_fails_says_the_weights_changed_and_their_version():
    async with faithful(flush_refused=True) as (server, driver):
        async with pool_on(driver.url) as pool:
            outcome = await pool.update_weights("/models/b", 1)
            engine = pool.engines[0]
        with pytest.raises(WeightsNotUpdated) as error:
            await driver.update_weights_from_disk("/models/c", "2")
    assert outcome["failed"] and engine.weight_version == "0"
    assert error.value.loaded and error.value.weight_version == "0"
    assert server.model_path == "/models/c" and server.paused is None


# 9 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("old_server", [False, True], ids=["0.5.23", "older"])
async def test_9_info_comes_from_the_current_paths_and_the_old_ones_on_older_servers(
        old_server):
    async with faithful(old_server=old_server) as (server, driver):
        info = await driver.model_info()
        server_info = await driver.server_info()
        await driver.model_info()
        healthy = await driver.health()
    assert info.model_path == "/models/a" and info.weight_version == "0"
    assert server_info["version"] == "0.5.23" and healthy
    expected = ["/get_model_info", "/get_server_info", "/get_model_info"] if old_server else []
    assert server.deprecated_calls == expected


async def test_the_faithful_server_answers_a_plain_http_client():
    """The fake is a real server: a request without the driver reaches it."""
    async with (serve_faithful(FaithfulSGLang()) as url, aiohttp.ClientSession() as http,
                http.post(url + "/generate", json={
                    "rid": "plain", "input_ids": list(PROMPT),
                    "sampling_params": {"max_new_tokens": 3}}) as reply):
        body = await reply.json()
    assert len(body["output_ids"]) == 3 and body["meta_info"]["finish_reason"]["type"] == "length"
