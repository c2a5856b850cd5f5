"""Capture through the vLLM driver: the gateway fronts a real vLLM server (the tiny model,
`vllm+http://...` engine URL) and a multi-turn chat's tree holds exactly the token IDs and
logprobs vLLM sampled; the second call's prompt extends the first call's prompt and
completion IDs verbatim.

"Exactly what vLLM sampled" is checked twice: against the logprobs the gateway streamed
back (which come from vLLM's reply), and against vLLM itself, asked directly (greedy, so
deterministic) for the same prompt IDs."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.capture import calls_of, captured
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.engines.vllm import VLLMDriver

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.vllm, pytest.mark.slow]


async def test_multi_turn_capture_through_vllm(make_gateway, vllm_engine_url):
    gateway = await make_gateway([f"vllm+{vllm_engine_url}"])
    session = await gateway.open_session()
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages = [{"role": "user", "content": "Describe the tree store."}]
    try:
        first = await client.chat.completions.create(model="m", messages=messages,
                                                     max_tokens=16, temperature=0.0,
                                                     logprobs=True)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "And the gateway?"}]
        stream = await client.chat.completions.create(model="m", messages=messages,
                                                      max_tokens=16, temperature=0.0,
                                                      logprobs=True, stream=True)
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()

    tree = gateway.tree()
    one, two = (captured(tree, call_id) for call_id in calls_of(tree, session["session_id"]))
    assert two.meta["token_truth"] and two.branch is None
    assert two.prompt_ids[:len(one.prompt_ids) + len(one.completion_ids)] == (
        one.prompt_ids + one.completion_ids)
    assert [item.logprob for item in first.choices[0].logprobs.content] == one.logprobs
    streamed = [item.logprob for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert streamed == two.logprobs
    for record in (one, two):
        assert record.completion_ids and all(record.trainable[len(record.prompt_ids):])

    async with VLLMDriver(vllm_engine_url) as vllm:
        for record in (one, two):
            direct = await vllm.generate(GenerateRequest(
                input_ids=tuple(record.prompt_ids), return_logprob=True,
                sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0)))
            assert direct.output_ids == record.completion_ids
            assert [lp for lp, _ in direct.output_token_logprobs] == pytest.approx(
                record.logprobs, abs=1e-4)
