"""Migration through the gateway (issue 7): an engine drained with `migrate` while a session
streams; the session continues on the other engine, the scaffold sees one uninterrupted reply,
and the stored tree holds exactly the tokens an unmigrated run samples, each with its logprob
and weight version. With both engines built-in, the KV moves with it (`migration.py`), and a
resume the target refuses falls back to sending all the IDs."""

from __future__ import annotations

import dataclasses
import logging
import re

import aiohttp
import openai
import pytest

from tests.builtin_engine.wire import generate, prompt
from tests.engines.conftest import start_builtin_engine
from tests.gateway.capture import calls_of, captured
from undertow.gateway.engine_pool.fleet import EngineRecord
from undertow.gateway.engine_pool.migration import MigrationConfig, StagedResume, resume_stream
from undertow.gateway.engines.protocol import (
    GenerateRequest,
    SamplingParams,
    StagedKV,
)
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.front.app import POOL_KEY
from undertow.gateway.kv_wire import PrefixDigest

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

NUM_TOKENS = 300


@pytest.fixture(scope="module")
def engine_pair(tiny_model_dir):
    with start_builtin_engine(tiny_model_dir) as first, \
            start_builtin_engine(tiny_model_dir) as second:
        yield first, second


async def unmigrated(urls: tuple[str, str], input_ids: list[int]) -> dict:
    """What an engine samples for the call when nothing moves; then both caches are emptied,
    so that nothing of the session is cached on the target but what migration puts there."""
    async with aiohttp.ClientSession() as http:
        reply = await generate(http, urls[0], input_ids=input_ids, return_logprob=True,
                               sampling_params={"max_new_tokens": NUM_TOKENS, "temperature": 0.0})
        for url in urls:
            async with http.post(url + "/flush_cache") as flushed:
                assert flushed.status == 200
    assert reply["meta_info"]["finish_reason"]["type"] == "length"
    return reply


@pytest.mark.parametrize("kv_transfer", [True, False])
async def test_drained_engines_session_continues_with_its_tree_exact(
        make_gateway, engine_pair, renderer, caplog, kv_transfer):
    input_ids = prompt(7, 400)
    expected = await unmigrated(engine_pair, input_ids)
    gateway = await make_gateway(list(engine_pair))
    pool = gateway.app[POOL_KEY]
    pool.config = dataclasses.replace(pool.config,
                                      migration=MigrationConfig(kv_transfer=kv_transfer))
    session = await gateway.open_session()
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    pieces, drained = [], None
    caplog.set_level(logging.INFO, logger="undertow.gateway.engine_pool.migration")
    try:
        stream = await client.completions.create(model="m", prompt=input_ids, stream=True,
                                                 max_tokens=NUM_TOKENS, temperature=0.0)
        async for chunk in stream:
            pieces += [choice.text for choice in chunk.choices]
            if len(pieces) == 5:
                (busy,) = [e for e in pool.describe() if e["num_in_flight"] == 1]
                drained = busy["id"]
                async with gateway.http.post(
                        f"{gateway.url}/admin/engines/{drained}/drain", json={"migrate": True},
                        headers=gateway.admin) as reply:
                    assert reply.status == 200, await reply.text()
    finally:
        await client.close()
    tree = gateway.tree()
    (call_id,) = calls_of(tree, session["session_id"])
    call = captured(tree, call_id)
    assert call.prompt_ids == input_ids
    assert call.completion_ids == expected["output_ids"]
    assert call.logprobs == pytest.approx(
        [entry[0] for entry in expected["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert call.weight_versions == [0] * NUM_TOKENS
    assert "".join(pieces) == renderer.decode(expected["output_ids"])
    assert pool.metrics.resumes.value(cause="migrate") == 1
    assert next(e for e in pool.describe() if e["id"] == drained)["state"] == "draining"
    moved = [int(match[1]) for record in caplog.records
             if (match := re.search(r"with (\d+) tokens of KV", record.getMessage()))]
    if kv_transfer:  # the target got the history: the prompt and at least the 5 tokens seen
        assert len(moved) == 1 and len(input_ids) + 5 <= moved[0] < len(input_ids) + NUM_TOKENS
    else:
        assert moved == []
    # The resume started from the staging (no fallback to re-prefill), which is used up.
    assert [
        r.getMessage()
        for r in caplog.records
        if r.name == "undertow.gateway.engine_pool.migration" and r.levelno >= logging.WARNING
    ] == []
    async with aiohttp.ClientSession() as http:
        for url in engine_pair:
            async with http.get(url + "/get_server_info") as reply:
                assert (await reply.json())["num_staged_tokens"] == 0


async def test_resume_refused_for_another_prefix_falls_back_to_the_whole_ids(engine_pair):
    """A staging named with the digest of another prefix: the engine refuses it, the resume
    sends all the IDs instead and continues exactly, and the gateway frees the staging."""
    source_url, target_url = engine_pair
    staged_ids, resumed_ids = prompt(8, 200), prompt(9, 200)
    async with aiohttp.ClientSession() as http, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        expected = await generate(http, target_url, input_ids=resumed_ids, return_logprob=True,
                                  sampling_params={"max_new_tokens": 20, "temperature": 0.0})
        await generate(http, source_url, input_ids=staged_ids,
                       sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        staging = await target.stage_kv(
            await source.export_kv(input_ids=staged_ids[:-1], span_ids=True))
        digest = PrefixDigest()
        digest.update(resumed_ids[:-1])
        engine = EngineRecord("e1", target_url, target)
        request = GenerateRequest(input_ids=resumed_ids, return_logprob=True,
                                  sampling_params=SamplingParams(max_new_tokens=20,
                                                                 temperature=0.0))
        pieces = [piece async for piece in resume_stream(engine, request, StagedResume(
            engine, target, StagedKV(staging.handle, staging.num_tokens, digest.hexdigest())))]
        async with http.get(target_url + "/get_server_info") as reply:
            num_staged = (await reply.json())["num_staged_tokens"]
    assert [t for p in pieces for t in p.output_ids] == expected["output_ids"]
    assert num_staged == 0
