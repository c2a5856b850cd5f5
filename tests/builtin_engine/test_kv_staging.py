"""Staged KV imports on the built-in engine (`undertow_kv.py`, `staging.py`): a sequence staged
on the target while its source decodes, then resumed by handle with only the tokens after the
staging, continues exactly as if it had never moved; a resume naming an unknown staging, or
one that holds another prefix, is refused before anything runs, and the staging is kept."""

import asyncio

import aiohttp
import pytest

from tests.builtin_engine.wire import generate, get, prompt, stream
from undertow.gateway.engines.protocol import EngineRejected, GenerateRequest, SamplingParams
from undertow.gateway.engines.sglang import SGLangDriver, StagedKV
from undertow.gateway.kv_wire import PrefixDigest

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NUM_TOKENS = 30


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir, start_engine):
    with start_engine(tiny_model_dir) as source, start_engine(tiny_model_dir) as target:
        yield source, target


def digest_of(token_ids: list[int]) -> str:
    digest = PrefixDigest()
    digest.update(token_ids)
    return digest.hexdigest()


def request_of(input_ids: list[int], max_new_tokens: int, rid: str) -> GenerateRequest:
    return GenerateRequest(input_ids=input_ids, rid=rid, return_logprob=True,
                           sampling_params=SamplingParams(temperature=0.0, ignore_eos=True,
                                                          max_new_tokens=max_new_tokens))


async def resume(driver: SGLangDriver, request: GenerateRequest, staged: StagedKV) -> dict:
    pieces = [p async for p in driver.generate_staged_stream(request, staged)]
    return {"output_ids": [t for p in pieces for t in p.output_ids],
            "logprobs": [lp for p in pieces for lp, _ in p.output_token_logprobs],
            "cached_tokens": pieces[-1].cached_tokens, "prompt_tokens": pieces[-1].prompt_tokens,
            "finish": pieces[-1].finish_reason.type}


async def reference(session, url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    reply = await generate(session, url, input_ids=input_ids, return_logprob=True,
                           sampling_params={**GREEDY, "max_new_tokens": max_new_tokens})
    return {"output_ids": reply["output_ids"],
            "logprobs": [e[0] for e in reply["meta_info"]["output_token_logprobs"]]}


async def stage_prompt(session, source: SGLangDriver, target: SGLangDriver, source_url: str,
                       ids: list[int], num_unstaged: int = 1) -> StagedKV:
    """Stage all of `ids` but the last `num_unstaged` tokens, from the source's cache, in two
    spans. (With one unstaged token the resume joins the decode step; with more, it prefills
    them.)"""
    await generate(session, source_url, input_ids=ids, sampling_params={**GREEDY,
                                                                         "max_new_tokens": 1})
    num_staged = len(ids) - num_unstaged
    first = await target.stage_kv(await source.export_kv(input_ids=ids[:40], span_ids=True))
    rest = await source.export_kv(input_ids=ids[:num_staged], start=first.num_tokens,
                                  span_ids=True)
    staged = await target.stage_kv(rest, first.handle)
    assert (staged.handle, staged.num_tokens) == (first.handle, num_staged)
    assert staged.digest == digest_of(ids[:num_staged])
    return staged


async def test_running_request_staged_then_stopped_resumes_exactly(two_engines):
    source_url, target_url = two_engines
    ids = prompt(21, 400)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        expected = await reference(session, target_url, ids, NUM_TOKENS)
        await target.flush_cache()
        num_cached_before = (await get(session, source_url, "/get_server_info"))[
            "num_cached_tokens"]
        stages: list[StagedKV] = []

        async def stage_then_stop(chunk):
            done = chunk["meta_info"]["completion_tokens"]
            if done >= 5 and not stages:
                stages.append(await target.stage_kv(
                    await source.export_kv(rid="moving", span_ids=True)))
            elif done >= 12 and len(stages) == 1:
                last = await source.export_kv(rid="moving", start=stages[0].num_tokens,
                                              span_ids=True, stop=True)
                stages.append(await target.stage_kv(last, stages[0].handle))

        chunks = await stream(session, source_url, on_chunk=stage_then_stop, rid="moving",
                              input_ids=ids, return_logprob=True,
                              sampling_params={**GREEDY, "max_new_tokens": 1000})
        source_info = await get(session, source_url, "/get_server_info")
        partial = chunks[-2]["output_ids"]
        staged = stages[-1]
        assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert staged.num_tokens == len(ids) + len(partial) - 1
        full = ids + partial
        tail = await resume(target, request_of(full, NUM_TOKENS - len(partial), "resumed"),
                            StagedKV(staged.handle, staged.num_tokens, digest_of(full[:-1])))
        target_info = await get(session, target_url, "/get_server_info")
    assert source_info["num_cached_tokens"] == num_cached_before  # the KV left, not cached
    assert (tail["cached_tokens"], tail["prompt_tokens"]) == (len(full) - 1, len(full))
    assert partial + tail["output_ids"] == expected["output_ids"]
    assert tail["logprobs"] == pytest.approx(expected["logprobs"][len(partial):], abs=1e-4)
    assert target_info["num_staged_tokens"] == 0


async def test_unknown_handle_is_a_404_saying_what_to_do(two_engines):
    async with SGLangDriver(two_engines[1]) as target:
        with pytest.raises(EngineRejected) as refused:
            await resume(target, request_of(prompt(22, 10), 4, "lost"),
                         StagedKV("no-such-handle", 9, digest_of(prompt(22, 9))))
    assert refused.value.status == 404
    assert "no staged KV with handle 'no-such-handle'" in refused.value.message
    assert "send the whole input_ids to /generate" in refused.value.message


async def test_handle_of_another_prefix_is_refused_and_nothing_is_lost(two_engines):
    source_url, target_url = two_engines
    ids, other = prompt(23, 120), prompt(24, 120)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        expected = await reference(session, source_url, ids, NUM_TOKENS)
        staged = await stage_prompt(session, source, target, source_url, ids)
        before = (await get(session, target_url, "/get_server_info"))["num_staged_tokens"]
        refusals = []
        for wrong in (StagedKV(staged.handle, staged.num_tokens, digest_of(other[:-1])),
                      StagedKV(staged.handle, staged.num_tokens - 1, digest_of(ids[:-2]))):
            with pytest.raises(EngineRejected) as refused:
                await resume(target, request_of(other, NUM_TOKENS, "wrong"), wrong)
            refusals.append(refused.value)
        after = (await get(session, target_url, "/get_server_info"))["num_staged_tokens"]
        tail = await resume(target, request_of(ids, NUM_TOKENS, "right"), staged)
    assert all(r.status == 409 and "holds another prefix" in r.message for r in refusals)
    assert before == after == len(ids) - 1
    assert tail["cached_tokens"] == len(ids) - 1
    assert tail["output_ids"] == expected["output_ids"]
    assert tail["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)


async def test_stagings_survive_other_requests_and_resume_in_any_order(two_engines):
    """Requests join and leave the target while two stagings wait; each resumes exactly."""
    source_url, target_url = two_engines
    first_ids, second_ids, busy_ids = prompt(25, 90), prompt(26, 150), prompt(27, 60)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        expected = [await reference(session, source_url, i, NUM_TOKENS)
                    for i in (first_ids, second_ids)]
        first = await stage_prompt(session, source, target, source_url, first_ids)
        second = await stage_prompt(session, source, target, source_url, second_ids,
                                    num_unstaged=3)
        await reference(session, target_url, busy_ids, 5)  # joins and leaves
        busy = asyncio.create_task(stream(session, target_url, input_ids=busy_ids,
                                          sampling_params={**GREEDY, "max_new_tokens": 400}))
        while (await get(session, target_url, "/get_server_info"))["num_running_reqs"] < 1:
            await asyncio.sleep(0.01)
        tails = []  # `first` now waits behind `second`: taking it swaps their slots
        for ids, staged in ((first_ids, first), (second_ids, second)):
            tails.append(await resume(target, request_of(ids, NUM_TOKENS, "r"), staged))
        busy_running = (await get(session, target_url, "/get_server_info"))["num_running_reqs"]
        await busy
    assert busy_running == 1
    assert [t["cached_tokens"] for t in tails] == [len(first_ids) - 1, len(second_ids) - 3]
    assert [t["output_ids"] for t in tails] == [e["output_ids"] for e in expected]
    assert [t["logprobs"] for t in tails] == [pytest.approx(e["logprobs"], abs=1e-4)
                                              for e in expected]


async def test_released_staging_is_gone(two_engines):
    source_url, target_url = two_engines
    ids = prompt(28, 64)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        staged = await stage_prompt(session, source, target, source_url, ids)
        await target.release_kv(staged.handle)
        with pytest.raises(EngineRejected) as again:
            await target.release_kv(staged.handle)
        with pytest.raises(EngineRejected) as resumed:
            await resume(target, request_of(ids, 4, "late"), staged)
        info = await get(session, target_url, "/get_server_info")
    assert again.value.status == resumed.value.status == 404
    assert info["num_staged_tokens"] == 0
