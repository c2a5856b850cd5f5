"""`VLLMDriver` against a real vLLM server (marker `vllm`), where vLLM 0.32's own code differs
from what the SGLang-shaped protocol assumes (see the `vllm.py` docstring): a weight update
pauses with "wait", which ends a "keep" pause, and resumes after the reload."""

import asyncio

import aiohttp
import pytest

from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams, result_from_chunks
from undertow.gateway.engines.vllm import VLLMDriver

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.vllm]

PROMPT = tuple(range(100, 140))


async def is_paused(url: str) -> bool:
    async with aiohttp.ClientSession() as http, http.get(url + "/is_paused") as reply:
        return (await reply.json())["is_paused"]


async def test_an_update_during_an_in_place_pause_leaves_the_engine_paused(
        vllm_engine_url, other_tiny_model_dir, tiny_model_dir):
    async with VLLMDriver(vllm_engine_url) as engine:
        before = (await engine.model_info()).weight_version
        chunks = []
        two_chunks = asyncio.Event()

        async def consume() -> None:
            async for chunk in engine.generate_stream(GenerateRequest(
                    input_ids=PROMPT, rid="held", sampling_params=SamplingParams(
                        max_new_tokens=32, temperature=0.0, ignore_eos=True))):
                chunks.append(chunk)
                if len(chunks) == 2:
                    two_chunks.set()

        consumer = asyncio.create_task(consume())
        await two_chunks.wait()
        await engine.pause("in_place")
        try:
            await engine.update_weights_from_disk(str(other_tiny_model_dir), "vllm-2")
            paused_after_update = await is_paused(vllm_engine_url)
            version = (await engine.model_info()).weight_version
        finally:
            await engine.resume()
            await consumer
            await engine.update_weights_from_disk(str(tiny_model_dir), before)
        paused_after_resume = await is_paused(vllm_engine_url)
    assert paused_after_update and not paused_after_resume
    assert version == "vllm-2"
    assert result_from_chunks(chunks).finish_reason.type == "length"
