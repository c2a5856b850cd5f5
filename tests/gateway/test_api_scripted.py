"""Each API through its real SDK (openai, anthropic, litellm), against the gateway in
front of the scripted engine: replies are parsed right and the tree holds exactly
the token IDs and logprobs the engine sampled."""

from __future__ import annotations

import json

import anthropic
import openai
import orjson
import pytest

from tests.gateway.capture import calls_of, captured
from undertow.gateway.front.app import SESSIONS_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOOL_TEXT = ('<think>\nCheck the files.\n</think>\n\nLooking.\n<tool_call>\n'
             '{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>')
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a shell command",
                    "input_schema": {"type": "object",
                                     "properties": {"cmd": {"type": "string"}}}}]


@pytest.fixture
async def clients():
    """Makes SDK clients and closes them (their connection pools) at teardown."""
    made = []

    def make(kind, **kwargs):
        client = (openai.AsyncOpenAI if kind == "openai" else anthropic.AsyncAnthropic)(**kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


def script(scripted, renderer, text: str) -> list[int]:
    token_ids = renderer.encode(text) + [2]
    scripted.scripts.append(token_ids)
    return token_ids


def assert_exact(gateway, scripted, session_id: str, group: str = "g"):
    """The session's last call in the tree is exactly what the engine sent."""
    tree = gateway.tree(group)
    call_id = calls_of(tree, session_id)[-1]
    got, sent = captured(tree, call_id), scripted.sent[call_id]
    assert got.prompt_ids == sent.input_ids
    assert got.completion_ids == sent.output_ids
    assert got.logprobs == sent.logprobs
    assert set(got.weight_versions) == {7}
    assert all(got.trainable[len(got.prompt_ids):])
    return got


async def test_openai_chat_plain_and_streaming(gateway, scripted, renderer, clients):
    session = await gateway.open_session()
    client = clients("openai", base_url=session["base_url"], api_key=session["api_key"])
    script(scripted, renderer, "Plain answer.")
    reply = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    assert reply.choices[0].message.content == "Plain answer."
    assert reply.choices[0].finish_reason == "stop"
    got = assert_exact(gateway, scripted, session["session_id"])
    assert [item.logprob for item in reply.choices[0].logprobs.content] == got.logprobs

    script(scripted, renderer, "Streamed answer, token by token.")
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi again"}], stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streamed answer, token by token."
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3
    got = assert_exact(gateway, scripted, session["session_id"])
    assert chunks[-1].usage.completion_tokens == len(got.completion_ids)


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_chat_tool_calls(gateway, scripted, renderer, clients, stream):
    session = await gateway.open_session()
    client = clients("openai", base_url=session["base_url"], api_key=session["api_key"])
    script(scripted, renderer, TOOL_TEXT)
    messages = [{"role": "user", "content": "list files"}]
    if stream:
        async with client.chat.completions.stream(model="m", messages=messages,
                                                  tools=OPENAI_TOOLS) as events:
            async for _ in events:
                pass
            reply = await events.get_final_completion()
    else:
        reply = await client.chat.completions.create(model="m", messages=messages,
                                                     tools=OPENAI_TOOLS)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content == "Looking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("bash", {"cmd": "ls -la"})]
    assert_exact(gateway, scripted, session["session_id"])


async def test_multi_turn_extends_prompt_and_completion_ids(gateway, scripted, renderer, clients):
    session = await gateway.open_session()
    client = clients("openai", base_url=session["base_url"], api_key=session["api_key"])
    script(scripted, renderer, TOOL_TEXT)
    messages = [{"role": "system", "content": "You fix bugs."},
                {"role": "user", "content": "list files"}]
    first = await client.chat.completions.create(model="m", messages=messages,
                                                 tools=OPENAI_TOOLS)
    one = assert_exact(gateway, scripted, session["session_id"])
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    messages += [assistant, {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                             "content": "a.py b.py"}]
    script(scripted, renderer, "Done.")
    await client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
    two = assert_exact(gateway, scripted, session["session_id"])
    assert two.prompt_ids[:len(one.prompt_ids) + len(one.completion_ids)] == (
        one.prompt_ids + one.completion_ids)
    assert two.branch is None and two.meta["token_truth"] is True

    rewritten = [messages[0], {"role": "user", "content": "list files (condensed)"}]
    await client.chat.completions.create(model="m", messages=rewritten, tools=OPENAI_TOOLS)
    three = assert_exact(gateway, scripted, session["session_id"])
    assert three.branch == "rewrite" and three.meta["token_truth"] is False


async def test_token_truth_hands_the_history_from_call_to_call_exactly(gateway, scripted,
                                                                        renderer, clients):
    """The newest head keeps its path's IDs (list and JSON) for the next call to take over;
    what the engine receives stays exactly the tree's prompt, call after call."""
    session = await gateway.open_session()
    client = clients("openai", base_url=session["base_url"], api_key=session["api_key"])
    messages = [{"role": "user", "content": "start"}]
    for turn in range(4):
        script(scripted, renderer, f"step {turn}")
        reply = await client.chat.completions.create(model="m", messages=messages)
        got = assert_exact(gateway, scripted, session["session_id"])
        assert got.meta["token_truth"] is (turn > 0)
        head = gateway.app[SESSIONS_KEY].get(session["session_id"]).heads[-1]
        path = gateway.tree().path_token_ids(head.leaf)
        assert head.token_ids == path and orjson.loads(head.token_ids_json.to_bytes()) == path
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"next {turn}"}]


async def test_openai_completions(gateway, scripted, renderer, clients):
    session = await gateway.open_session()
    client = clients("openai", base_url=session["base_url"], api_key=session["api_key"])
    script(scripted, renderer, "and then")
    reply = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=20,
                                            logprobs=1)
    assert reply.choices[0].text == "and then"
    got = assert_exact(gateway, scripted, session["session_id"])
    assert got.prompt_ids == renderer.encode("Once upon a time")
    assert reply.choices[0].logprobs.token_logprobs == got.logprobs
    script(scripted, renderer, " streamed")
    stream = await client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=20,
                                             stream=True)
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert text == " streamed"
    assert assert_exact(gateway, scripted, session["session_id"]).prompt_ids == [5, 6, 7]


async def test_anthropic_messages_plain_tools_and_streaming(gateway, scripted, renderer, clients):
    session = await gateway.open_session()
    base = session["base_url"].removesuffix("/v1")
    client = clients("anthropic", base_url=base, api_key=session["api_key"])
    script(scripted, renderer, "Plain.")
    reply = await client.messages.create(model="claude-x", max_tokens=64,
                                         messages=[{"role": "user", "content": "hi"}])
    assert [block.text for block in reply.content] == ["Plain."]
    assert reply.stop_reason == "end_turn"
    assert_exact(gateway, scripted, session["session_id"])

    script(scripted, renderer, TOOL_TEXT)
    messages = [{"role": "user", "content": "list files"}]
    reply = await client.messages.create(model="claude-x", max_tokens=64, messages=messages,
                                         tools=ANTHROPIC_TOOLS)
    kinds = [block.type for block in reply.content]
    assert kinds == ["thinking", "text", "tool_use"] and reply.stop_reason == "tool_use"
    assert reply.content[0].thinking == "Check the files."
    assert reply.content[2].input == {"cmd": "ls -la"}
    first = assert_exact(gateway, scripted, session["session_id"])

    # The thinking block goes back with the history and the prompt extends token-exactly.
    messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result",
                                               "tool_use_id": reply.content[2].id,
                                               "content": "a.py"}]}]
    script(scripted, renderer, TOOL_TEXT)
    async with client.messages.stream(model="claude-x", max_tokens=64, messages=messages,
                                       tools=ANTHROPIC_TOOLS) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"cmd": "ls -la"}
    second = assert_exact(gateway, scripted, session["session_id"])
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)

    count = await client.messages.count_tokens(model="claude-x", messages=messages,
                                               tools=ANTHROPIC_TOOLS)
    assert count.input_tokens > len(first.prompt_ids)


async def test_responses_streaming(gateway, scripted, renderer, clients):
    session = await gateway.open_session()
    client = clients("openai", base_url=session["base_url"], api_key=session["api_key"])
    script(scripted, renderer, TOOL_TEXT)
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]
    stream = await client.responses.create(model="m", input="list files", tools=tools,
                                           stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    output = events[-1].response.output
    assert [item.type for item in output] == ["reasoning", "message", "function_call"]
    assert json.loads(output[2].arguments) == {"cmd": "ls -la"}
    assert any(event.type == "response.output_text.delta" for event in events)
    assert_exact(gateway, scripted, session["session_id"])


async def test_litellm_chat_streaming(gateway, scripted, renderer):
    import litellm

    session = await gateway.open_session()
    script(scripted, renderer, "From litellm.")
    reply = await litellm.acompletion(model="openai/m", api_base=session["base_url"],
                                      api_key=session["api_key"],
                                      messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "From litellm."
    assert_exact(gateway, scripted, session["session_id"])
    script(scripted, renderer, TOOL_TEXT)
    stream = await litellm.acompletion(model="openai/m", api_base=session["base_url"],
                                       api_key=session["api_key"], stream=True,
                                       tools=OPENAI_TOOLS,
                                       messages=[{"role": "user", "content": "hi"}])
    chunks = [chunk async for chunk in stream]
    rebuilt = litellm.stream_chunk_builder(chunks)
    call = rebuilt.choices[0].message.tool_calls[0]
    assert call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"cmd": "ls -la"}
    assert_exact(gateway, scripted, session["session_id"])


async def test_sdk_retry_is_answered_again_not_recorded_twice(gateway, scripted, renderer):
    session = await gateway.open_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "once"}]}
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    url = f"{session['base_url']}/chat/completions"
    script(scripted, renderer, "only once")
    async with gateway.http.post(url, json=body, headers=headers) as reply:
        first = await reply.json()
    retry_headers = {**headers, "x-stainless-retry-count": "1"}
    async with gateway.http.post(url, json=body, headers=retry_headers) as reply:
        again = await reply.json()
    assert again["choices"] == first["choices"]
    assert len(calls_of(gateway.tree(), session["session_id"])) == 1
    assert scripted.num_requests == 1
