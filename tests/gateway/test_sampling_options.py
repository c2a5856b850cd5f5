"""Sampling options through the real SDKs. Against the real built-in engine (tiny model,
random weights): `n` and `stop` are recorded exactly, and forced tool calls and JSON
output formats come out obeying their schemas (only constrained decoding can make
random weights do that). Against the scripted engine: which SGLang structured-output
parameters each API's `tool_choice`, `parallel_tool_calls` and output format send, and
the 400s that name what cannot be honoured."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.gateway.capture import calls_of, captured
from undertow.gateway.front.toolparsers import PARSERS, forced_structural_tag

pytestmark = pytest.mark.asyncio(loop_scope="session")

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


@pytest.mark.slow
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


@pytest.mark.slow
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


TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["cmd"],
        "properties": {"cmd": {"enum": ["ls", "pwd", "make test"]}}}}},
    {"type": "function", "function": {
        "name": "done", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["ok"],
                                       "properties": {"ok": {"type": "boolean"}}}}}]
ANSWER = {"type": "object", "additionalProperties": False, "required": ["verdict", "score"],
          "properties": {"verdict": {"enum": ["pass", "fail"]},
                         "score": {"type": "integer", "minimum": 0, "maximum": 9}}}


def obeys_tools(name: str, arguments: dict) -> bool:
    if name == "bash":
        return set(arguments) == {"cmd"} and arguments["cmd"] in ("ls", "pwd", "make test")
    return name == "done" and set(arguments) == {"ok"} and isinstance(arguments["ok"], bool)


def obeys_answer(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"verdict", "score"}
            and value["verdict"] in ("pass", "fail") and isinstance(value["score"], int)
            and not isinstance(value["score"], bool) and 0 <= value["score"] <= 9)


@pytest.mark.slow
async def test_forced_tool_calls_and_json_output_obey_their_schemas_on_random_weights(
        make_gateway, engine_url, client_of):
    gateway = await make_gateway([engine_url])
    client = client_of(await gateway.open_session())
    for seed in (1, 2, 3):
        free = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=48, seed=seed)
        assert not free.choices[0].message.tool_calls  # random weights never call by chance
        forced = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=96,
            seed=seed, parallel_tool_calls=False)  # random weights would add calls forever
        calls = forced.choices[0].message.tool_calls
        assert calls and forced.choices[0].finish_reason == "tool_calls", forced
        assert all(obeys_tools(c.function.name, json.loads(c.function.arguments))
                   for c in calls)
        named = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=96, seed=seed,
            tool_choice={"type": "function", "function": {"name": "done"}},
            parallel_tool_calls=False)
        calls = named.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "done"
        assert obeys_tools("done", json.loads(calls[0].function.arguments))
        answer = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=64, seed=seed, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
        assert obeys_answer(json.loads(answer.choices[0].message.content))


@pytest.fixture
async def scripted_client(gateway, clients_of_session):
    return await clients_of_session(gateway)


@pytest.fixture
async def clients_of_session():
    made = []

    async def make(gateway):
        session = await gateway.open_session()
        made.append(openai.AsyncOpenAI(base_url=session["base_url"],
                                       api_key=session["api_key"], max_retries=0))
        made.append(anthropic.AsyncAnthropic(
            base_url=session["base_url"].removesuffix("/v1"), api_key=session["api_key"],
            max_retries=0))
        return made[-2], made[-1]

    yield make
    for client in made:
        await client.close()


def sent_params(gateway, scripted) -> dict:
    """The sampling parameters of the newest call the engine received."""
    call_id = gateway.tree().calls[-1].call_id
    return scripted.sent[call_id].sampling_params


async def test_each_api_sends_the_forced_call_schema(gateway, scripted, renderer,
                                                     scripted_client):
    openai_client, anthropic_client = scripted_client
    reply_ids = renderer.encode('<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n'
                                '</tool_call>') + [2]  # the tiny model's own (Hermes) format
    scripted.scripts += [list(reply_ids) for _ in range(4)]
    reply = await openai_client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert sent_params(gateway, scripted)["structural_tag"] == forced_structural_tag(
        PARSERS["hermes"], TOOLS, None)
    call = reply.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"cmd": "ls"})

    await openai_client.responses.create(
        model="m", input="hi", tools=[{"type": "function", **TOOLS[0]["function"]}],
        tool_choice={"type": "function", "name": "bash"}, parallel_tool_calls=False)
    assert sent_params(gateway, scripted)["structural_tag"] == forced_structural_tag(
        PARSERS["hermes"], TOOLS[:1], "bash", parallel=False)

    message = await anthropic_client.messages.create(
        model="m", max_tokens=64, messages=MESSAGES, tool_choice={"type": "any"},
        tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
               for t in TOOLS])
    assert json.loads(sent_params(gateway, scripted)["structural_tag"])["format"]["at_least_one"]
    assert (message.content[0].name, message.content[0].input) == ("bash", {"cmd": "ls"})
    assert message.stop_reason == "tool_use"


async def test_output_formats_and_one_call_at_most(gateway, scripted, renderer, scripted_client):
    openai_client, anthropic_client = scripted_client
    scripted.scripts.append(renderer.encode('{"verdict": "pass", "score": 3}') + [2])
    reply = await openai_client.chat.completions.create(
        model="m", messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    assert json.loads(sent_params(gateway, scripted)["json_schema"]) == ANSWER
    assert json.loads(reply.choices[0].message.content) == {"verdict": "pass", "score": 3}

    await openai_client.responses.create(model="m", input="hi",
                                         text={"format": {"type": "json_object"}})
    assert json.loads(sent_params(gateway, scripted)["json_schema"]) == {"type": "object"}

    await anthropic_client.messages.create(
        model="m", max_tokens=32, messages=MESSAGES,
        extra_body={"output_format": {"type": "json_schema", "schema": ANSWER}})
    assert json.loads(sent_params(gateway, scripted)["json_schema"]) == ANSWER

    await openai_client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS,
                                                parallel_tool_calls=False)
    params = sent_params(gateway, scripted)
    assert params["stop"] == ["</tool_call>"] and "json_schema" not in params


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_it(scripted_client, extra, param):
    openai_client, _ = scripted_client
    with pytest.raises(openai.BadRequestError) as error:
        await openai_client.chat.completions.create(model="m", messages=MESSAGES, **extra)
    assert error.value.body["param"] == param
