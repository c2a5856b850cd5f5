"""Chunked prefill in the built-in engine: the same outputs as a whole prefill, and the running
requests decode while a long prompt is prefilled (`scheduler.py`)."""

import asyncio

import aiohttp
import pytest

from tests.builtin_engine.wire import generate, get, greedy, post, prompt, stream
from undertow.gateway.builtin_engine.model import CausalLM, ModelConfig, load_weights
from undertow.gateway.builtin_engine.radix_cache import RadixCache
from undertow.gateway.builtin_engine.scheduler import Scheduler, attention_tokens

SMALL_CHUNKS = "16"  # token equivalents: a 600-token prompt takes dozens of chunks
IDLE_CHUNKS = "64"  # max_prefill_tokens: the chunks' bound when no other request decodes
LONG_PROMPT = 600


@pytest.fixture(scope="module")
def engines(tiny_model_dir, start_engine):
    """(whole, chunked): the tiny model prefilled whole and in small chunks (while idle too:
    its max_prefill_tokens is small)."""
    with start_engine(tiny_model_dir, "chunked_prefill_size=0") as whole, \
            start_engine(tiny_model_dir, f"chunked_prefill_size={SMALL_CHUNKS}",
                         f"max_prefill_tokens={IDLE_CHUNKS}") as chunked:
        yield whole, chunked


def make_scheduler(model_dir, size: int, max_prefill_tokens: int = 16384) -> Scheduler:
    config = ModelConfig.from_dir(model_dir)
    return Scheduler(CausalLM(config, load_weights(model_dir, config)), RadixCache(0), str,
                     frozenset(), 4, lambda updates: None, "0", chunked_prefill_size=size,
                     max_prefill_tokens=max_prefill_tokens)


def test_chunks_shrink_as_the_prefix_grows_and_always_progress(tiny_model_dir):
    scheduler = make_scheduler(tiny_model_dir, 256)
    scale = attention_tokens(scheduler.model.config)
    assert scheduler.chunk_length(0, 10) == 10
    first = scheduler.chunk_length(0, 100_000)
    late = scheduler.chunk_length(16_000, 100_000)
    assert first > late >= 1
    for start, n in ((0, first), (16_000, late)):  # the largest within the size
        assert n * (scale + start + n) <= 256 * scale < (n + 1) * (scale + start + n + 1)
    assert scheduler.chunk_length(10**9, 5) == 1
    assert make_scheduler(tiny_model_dir, 0).chunk_length(16_000, 20_000) == 20_000


def test_with_no_other_request_decoding_chunks_are_bounded_by_max_prefill_tokens(
        tiny_model_dir):
    """Idle, a 2,000-token prompt goes whole (its cost is within max_prefill_tokens), where
    busy it takes 256-token-equivalent chunks; a longer one is still cut, at the larger bound."""
    scheduler = make_scheduler(tiny_model_dir, 256, max_prefill_tokens=16384)
    scale = attention_tokens(scheduler.model.config)
    assert scheduler.chunk_length(0, 2000, idle=True) == 2000
    assert scheduler.chunk_length(0, 2000) < 256
    n = scheduler.chunk_length(0, 100_000, idle=True)
    assert n * (scale + n) <= 16384 * scale < (n + 1) * (scale + n + 1)


async def test_outputs_and_logprobs_are_those_of_a_whole_prefill(engines):
    whole, chunked = engines
    body = {"input_ids": prompt(7, LONG_PROMPT), "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": greedy(12, ignore_eos=True)}
    async with aiohttp.ClientSession() as session:
        expected = await generate(session, whole, **body)
        got = await generate(session, chunked, **body)
        cached = await generate(session, chunked, **{**body, "logprob_start_len": -1})
    assert got["output_ids"] == expected["output_ids"] == cached["output_ids"]
    assert cached["meta_info"]["cached_tokens"] >= LONG_PROMPT - 1
    for key in ("input_token_logprobs", "output_token_logprobs"):
        mine, theirs = got["meta_info"][key], expected["meta_info"][key]
        assert len(mine) == len(theirs) == (LONG_PROMPT if key.startswith("input") else 12)
        assert [t for _, t, _ in mine] == [t for _, t, _ in theirs]
        for (a, _, _), (b, _, _) in zip(mine, theirs, strict=True):
            assert (a is None and b is None) or abs(a - b) < 1e-4
    tops = got["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and len(tops) == LONG_PROMPT
    assert [[t for _, t, _ in top] for top in tops[1:]] == \
        [[t for _, t, _ in top] for top in expected["meta_info"]["input_top_logprobs"][1:]]


async def decode_steps_during_a_long_prefill(url: str, seed: int) -> tuple[int, list[int]]:
    """Decode steps the engine ran while a long prompt was prefilled with one request
    decoding, and that request's output (aborted afterwards)."""
    async with aiohttp.ClientSession() as session:
        started = asyncio.Event()

        async def on_chunk(chunk):
            started.set()

        running = asyncio.create_task(stream(
            session, url, on_chunk, input_ids=prompt(seed, 20), rid=f"runner-{seed}",
            sampling_params=greedy(4000, ignore_eos=True)))
        await started.wait()
        before = (await get(session, url, "/get_server_info"))["num_decode_steps"]
        await generate(session, url, input_ids=prompt(seed + 1, LONG_PROMPT),
                       sampling_params=greedy(1))
        after = (await get(session, url, "/get_server_info"))["num_decode_steps"]
        await post(session, url, "/abort_request", {"rid": f"runner-{seed}"})
        chunks = await running
    return after - before, chunks[-2]["output_ids"]


async def test_running_requests_decode_between_the_chunks_of_a_long_prompt(engines,
                                                                           tiny_model_dir):
    whole, chunked = engines
    num_chunks = 0
    scheduler, start = make_scheduler(tiny_model_dir, int(SMALL_CHUNKS)), 0
    while start < LONG_PROMPT:
        start += scheduler.chunk_length(start, LONG_PROMPT - start)
        num_chunks += 1
    assert num_chunks > 20
    steps_chunked, output_chunked = await decode_steps_during_a_long_prefill(chunked, 40)
    steps_whole, _ = await decode_steps_during_a_long_prefill(whole, 40)
    assert steps_chunked >= num_chunks - 1  # one decode step after every chunk but the last
    # The whole prefill held the batch: only the steps around it, while the requests that
    # read the counter travel (more on a loaded machine: 4 at load 18), fewer than one a chunk.
    assert steps_whole < num_chunks - 1
    assert len(output_chunked) > 20
    async with aiohttp.ClientSession() as session:
        alone = await generate(session, whole, input_ids=prompt(40, 20),
                               sampling_params=greedy(len(output_chunked), ignore_eos=True))
    assert output_chunked == alone["output_ids"]


async def test_a_request_aborted_or_retracted_mid_prefill_leaves_the_engine_exact(engines):
    whole, chunked = engines
    reference_ids = prompt(60, 30)
    async with aiohttp.ClientSession() as session:
        expected = await generate(session, whole, input_ids=reference_ids,
                                  sampling_params=greedy(10, ignore_eos=True))
        long_body = {"input_ids": prompt(61, LONG_PROMPT), "rid": "long-61",
                     "sampling_params": greedy(5, ignore_eos=True)}
        aborted = asyncio.create_task(generate(session, chunked, **long_body))
        await asyncio.sleep(0.05)
        await post(session, chunked, "/abort_request", {"rid": "long-61"})
        reply = await aborted
        assert reply["meta_info"]["finish_reason"]["type"] in ("abort", "length")

        retracted = asyncio.create_task(generate(session, chunked, **{**long_body,
                                                                       "rid": "long-62"}))
        await asyncio.sleep(0.05)
        await post(session, chunked, "/pause_generation", {"mode": "retract"})
        await post(session, chunked, "/continue_generation")
        resumed = await retracted
        after = await generate(session, chunked, input_ids=reference_ids,
                               sampling_params=greedy(10, ignore_eos=True))
        reference = await generate(session, whole, **{**long_body, "rid": "long-63"})
    assert resumed["output_ids"] == reference["output_ids"]
    assert after["output_ids"] == expected["output_ids"]
