"""`n` and `stop` through the OpenAI SDK against the gateway in front of the real built-in
engine (tiny model): every choice is recorded exactly, and a stop string ends the reply
where the engine matched it."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.capture import calls_of, captured

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Tell me about the tree store."}]


@pytest.fixture
async def client_of():
    made = []

    def make(session: dict) -> openai.AsyncOpenAI:
        made.append(openai.AsyncOpenAI(base_url=session["base_url"],
                                       api_key=session["api_key"]))
        return made[-1]

    yield make
    for client in made:
        await client.close()


async def test_n_choices_are_each_recorded_exactly(make_gateway, engine_url, client_of):
    gateway = await make_gateway([engine_url])
    session = await gateway.open_session()
    reply = await client_of(session).chat.completions.create(
        model="m", messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=11,
        logprobs=True)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    tree = gateway.tree()
    call_ids = calls_of(tree, session["session_id"])
    assert len(call_ids) == 3
    records = [captured(tree, call_id) for call_id in call_ids]
    assert [record.branch for record in records[1:]] == ["sample", "sample"]
    assert records[0].prompt_ids == records[1].prompt_ids == records[2].prompt_ids
    for choice, record in zip(reply.choices, records, strict=True):
        assert [item.logprob for item in choice.logprobs.content] == record.logprobs
        assert all(record.trainable[len(record.prompt_ids):])
    assert reply.usage.completion_tokens == sum(len(r.completion_ids) for r in records)
    # Distinct seeds per choice: three samples at temperature 1 are not all the same.
    assert len({tuple(record.completion_ids) for record in records}) > 1


async def test_stop_string_ends_the_reply_and_the_tree_holds_what_was_sampled(
        make_gateway, engine_url, client_of, renderer):
    gateway = await make_gateway([engine_url])
    client = client_of(await gateway.open_session())
    free = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24,
                                                temperature=0.0)
    text = free.choices[0].message.content
    assert len(text) > 8, "the tiny model's greedy reply is too short to cut"
    stop = text[len(text) // 2:len(text) // 2 + 3]
    session = await gateway.open_session()
    cut = await client_of(session).chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=24, temperature=0.0, stop=[stop])
    content = cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in content
    assert text.startswith(content) and len(content) < len(text)
    stream = await client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=24, temperature=0.0, stop=[stop], stream=True)
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == content
    record = captured(gateway.tree(), calls_of(gateway.tree(), session["session_id"])[0])
    sampled = renderer.decode(record.completion_ids)
    assert sampled.startswith(content) and stop in sampled
    assert record.meta["finish_reason"]["type"] == "stop"
    assert record.meta["sampling"]["stop"] == [stop]
