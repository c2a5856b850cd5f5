"""`/generate` on the built-in engine: exact logprobs, batching-invariant greedy outputs,
seeded sampling, the prefix cache, streaming, stop conditions."""

import asyncio
import itertools

import aiohttp
import pytest
import torch

from tests.builtin_engine.wire import generate, get, greedy, post, prompt, stream


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def log_softmax_rows(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0], -1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_logprobs_equal_a_transformers_forward(builtin_engine_url, reference_model,
                                                     temperature):
    input_ids = prompt(1, 30)
    async with aiohttp.ClientSession() as session:
        reply = await generate(
            session, builtin_engine_url, input_ids=input_ids, return_logprob=True,
            logprob_start_len=0, top_logprobs_num=3,
            sampling_params={"max_new_tokens": 12, "temperature": temperature,
                             "sampling_seed": 5, "ignore_eos": True})
    output_ids = reply["output_ids"]
    meta = reply["meta_info"]
    assert len(output_ids) == 12 == meta["completion_tokens"]
    expected = log_softmax_rows(reference_model, input_ids + output_ids)
    for i, (logprob, token_id, text) in enumerate(meta["output_token_logprobs"]):
        assert token_id == output_ids[i] and text is None
        assert abs(logprob - expected[len(input_ids) - 1 + i, token_id].item()) < 1e-4
    inputs = meta["input_token_logprobs"]
    assert inputs[0][0] is None and [t for _, t, _ in inputs] == input_ids
    for position, (logprob, token_id, _) in enumerate(inputs[1:], start=1):
        assert abs(logprob - expected[position - 1, token_id].item()) < 1e-4
    top = meta["output_top_logprobs"][0]
    best = expected[len(input_ids) - 1].topk(3)
    assert [t for _, t, _ in top] == best.indices.tolist()


async def test_greedy_is_the_same_alone_batched_and_with_a_cached_prefix(builtin_engine_url):
    prefix = prompt(2, 40)
    prompts = [prefix + prompt(100 + i, 5 + 3 * i) for i in range(8)]
    params = greedy(16, ignore_eos=True)
    url = builtin_engine_url
    async with aiohttp.ClientSession() as session:
        alone = []
        for ids in prompts:
            await post(session, url, "/flush_cache")
            alone.append(await generate(session, url, input_ids=ids, sampling_params=params))
        assert all(r["meta_info"]["cached_tokens"] == 0 for r in alone)

        await post(session, url, "/flush_cache")
        steps_before = (await get(session, url, "/get_server_info"))["num_decode_steps"]
        batched = await asyncio.gather(*(generate(session, url, input_ids=ids,
                                                  sampling_params=params) for ids in prompts))
        steps = (await get(session, url, "/get_server_info"))["num_decode_steps"] - steps_before
        cached = [await generate(session, url, input_ids=ids, sampling_params=params)
                  for ids in prompts]

    assert steps < 8 * 15 / 2, "the 8 requests did not share decode steps"
    expected = [r["output_ids"] for r in alone]
    assert [r["output_ids"] for r in batched] == expected
    assert [r["output_ids"] for r in cached] == expected
    assert all(r["meta_info"]["cached_tokens"] >= len(ids) - 1
               for r, ids in zip(cached, prompts, strict=True))


async def test_shared_prefix_is_reported_as_cached_tokens(builtin_engine_url):
    prefix = prompt(3, 64)
    async with aiohttp.ClientSession() as session:
        await post(session, builtin_engine_url, "/flush_cache")
        first = await generate(session, builtin_engine_url, input_ids=prefix + prompt(4, 8),
                               sampling_params=greedy(4))
        second = await generate(session, builtin_engine_url, input_ids=prefix + prompt(5, 8),
                                sampling_params=greedy(4))
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 64


async def test_sampling_seed_makes_sampling_reproducible(builtin_engine_url):
    def params(seed):
        return {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": seed,
                "ignore_eos": True}

    input_ids = prompt(6, 12)
    url = builtin_engine_url
    async with aiohttp.ClientSession() as session:
        first = await generate(session, url, input_ids=input_ids, sampling_params=params(1))
        crowd = [generate(session, url, input_ids=prompt(7 + i, 20), sampling_params=params(i))
                 for i in range(5)]
        again, *_ = await asyncio.gather(
            generate(session, url, input_ids=input_ids, sampling_params=params(1)), *crowd)
        other = await generate(session, url, input_ids=input_ids, sampling_params=params(2))
    assert again["output_ids"] == first["output_ids"]
    assert other["output_ids"] != first["output_ids"]


async def test_streaming_chunks_are_cumulative_and_end_with_done(builtin_engine_url):
    input_ids = prompt(8, 10)
    params = greedy(10, ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        chunks = await stream(session, builtin_engine_url, input_ids=input_ids,
                              sampling_params=params, return_logprob=True)
        whole = await generate(session, builtin_engine_url, input_ids=input_ids,
                               sampling_params=params, return_logprob=True)
    assert chunks[-1] == "[DONE]"
    chunks = chunks[:-1]
    assert len(chunks) >= 2
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][:len(earlier["output_ids"])] == earlier["output_ids"]
        assert earlier["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"]
    assert last["text"] == whole["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert len(last["meta_info"]["output_token_logprobs"]) == 10
    assert last["meta_info"]["weight_version"] == whole["meta_info"]["weight_version"]


async def test_stop_token_and_stop_string_finish_and_are_trimmed_from_text(builtin_engine_url):
    input_ids = prompt(9, 10)
    url = builtin_engine_url
    async with aiohttp.ClientSession() as session:
        free = await generate(session, url, input_ids=input_ids,
                              sampling_params=greedy(12, ignore_eos=True))
        stop_token = free["output_ids"][3]
        by_token = await generate(session, url, input_ids=input_ids,
                                  sampling_params=greedy(12, stop_token_ids=[stop_token]))
        stop_text = free["text"][len(free["text"]) // 2:][:3]
        by_text = await generate(session, url, input_ids=input_ids,
                                 sampling_params=greedy(12, ignore_eos=True, stop=[stop_text]))
    cut = free["output_ids"].index(stop_token) + 1
    assert by_token["output_ids"] == free["output_ids"][:cut]
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in by_text["text"]
    assert free["text"].startswith(by_text["text"])


async def test_text_input_and_info_routes(builtin_engine_url, tiny_model_dir):
    async with aiohttp.ClientSession() as session:
        reply = await generate(session, builtin_engine_url, text="def main():",
                               sampling_params=greedy(3))
        model_info = await get(session, builtin_engine_url, "/get_model_info")
        version = await get(session, builtin_engine_url, "/get_weight_version")
        load = await get(session, builtin_engine_url, "/get_server_info")
        async with session.get(builtin_engine_url + "/health_generate") as health:
            assert health.status == 200
    assert reply["meta_info"]["prompt_tokens"] > 0 and len(reply["output_ids"]) == 3
    assert model_info["model_path"] == str(tiny_model_dir) and model_info["is_generation"]
    assert version["weight_version"] == reply["meta_info"]["weight_version"]
    assert load["num_running_reqs"] == 0 and "num_waiting_reqs" in load
