"""The gateway in front of the real built-in engine (tiny model, random text): the tree
holds exactly what the engine sampled, and 200 concurrent sessions lose no call and
never mix."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.gateway.capture import calls_of, captured

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]


async def test_chat_capture_matches_engine_logprobs(make_gateway, engine_url, renderer):
    gateway = await make_gateway([engine_url])
    session = await gateway.open_session()
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    try:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=12,
            logprobs=True)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"},
                                 reply.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": "again"}],
            max_tokens=12, logprobs=True, stream=True)
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    tree = gateway.tree()
    first, second = (captured(tree, call_id)
                     for call_id in calls_of(tree, session["session_id"]))
    assert [item.logprob for item in reply.choices[0].logprobs.content] == first.logprobs
    assert "".join(item.token for item in reply.choices[0].logprobs.content) == \
        renderer.decode(first.completion_ids, skip_special_tokens=False)
    streamed = [item.logprob for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert streamed == second.logprobs
    assert len(first.completion_ids) == reply.usage.completion_tokens
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    assert all(version >= 0 for version in first.weight_versions + second.weight_versions)


async def test_200_concurrent_sessions_lose_nothing_and_never_mix(make_gateway, engine_url,
                                                                  renderer):
    gateway = await make_gateway([engine_url])
    sessions = await asyncio.gather(*(gateway.open_session(group=f"g{n % 10}")
                                      for n in range(200)))
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=8)

    async def one(number: int, session: dict) -> str:
        reply = await client.with_options(api_key=session["api_key"]).chat.completions.create(
            model="m", max_tokens=3, stream=number % 2 == 0,
            messages=[{"role": "user", "content": f"session number {number}"}])
        if number % 2 == 0:
            return "".join([c.choices[0].delta.content or "" async for c in reply if c.choices])
        return reply.choices[0].message.content

    try:
        await asyncio.gather(*(one(n, s) for n, s in enumerate(sessions)))
    finally:
        await client.close()
    for number, session in enumerate(sessions):
        tree = gateway.tree(f"g{number % 10}")
        call_ids = calls_of(tree, session["session_id"])
        assert len(call_ids) == 1
        prompt = renderer.decode(captured(tree, call_ids[0]).prompt_ids)
        assert f"session number {number}\n" in prompt
