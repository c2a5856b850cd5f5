"""Reasoning and a non-Hermes tool format through the real SDKs: a gateway on a model
directory whose template opens the think block in the generation prompt and writes
Qwen3-Coder XML tool calls (`thinking_template.py`; `--tool-parser auto` must pick
`qwen3_coder`), in front of the scripted engine. Each API returns the reasoning its
own way (`reasoning_content`, `thinking` blocks, `reasoning` items), streamed and not;
template arguments reach the template; a malformed call comes back as text and is
counted; bad values are 400s that name the field."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest

from tests.gateway.capture import calls_of
from tests.gateway.conftest import ADMIN_TOKEN, Gateway, start_gateway
from tests.gateway.thinking_template import HARMONY, thinking_model_dir
from undertow.gateway.front.app import METRICS_KEY, RUNNER_KEY, STORE_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")

COMPLETION = ("I should list the files.\n</think>\n\nListing.\n<tool_call>\n<function=bash>\n"
              "<parameter=cmd>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n"
              "</function>\n</tool_call>")
TOOL = {"name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"},
                                                        "timeout": {"type": "integer"}}}}
OPENAI_TOOLS = [{"type": "function", "function": TOOL}]
ANTHROPIC_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"],
                    "input_schema": TOOL["parameters"]}]
ASK = [{"role": "user", "content": "list files"}]
ARGUMENTS = {"cmd": "ls -la", "timeout": 30}


@pytest.fixture(scope="module")
def thinking_dir(tiny_model_dir, tmp_path_factory):
    return thinking_model_dir(tiny_model_dir, tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture
async def gateway(scripted, thinking_dir, tmp_path):
    app, runner, url = await start_gateway([scripted.url], thinking_dir, tmp_path / "store",
                                           tool_parser="auto")
    async with aiohttp.ClientSession() as http:
        yield Gateway(url, app, tmp_path / "store", http)
    await runner.cleanup()


@pytest.fixture
async def session(gateway):
    return await gateway.open_session()


@pytest.fixture
async def clients(session):
    made = []

    def make(kind):
        if kind == "openai":
            client = openai.AsyncOpenAI(base_url=session["base_url"],
                                        api_key=session["api_key"], max_retries=0)
        else:  # the Anthropic SDK adds /v1 itself
            client = anthropic.AsyncAnthropic(base_url=session["base_url"].removesuffix("/v1"),
                                              api_key=session["api_key"], max_retries=0)
        made.append(client)
        return made[-1]

    yield make
    for client in made:
        await client.close()


def script(scripted, renderer, text: str) -> None:
    scripted.scripts.append(renderer.encode(text) + [2])


def last_prompt(gateway, scripted, renderer, session) -> str:
    """The prompt the engine got for the session's last call, as text."""
    call_id = calls_of(gateway.tree(), session["session_id"])[-1]
    return renderer.decode(scripted.sent[call_id].input_ids, skip_special_tokens=False)


async def test_auto_picks_the_templates_format(gateway):
    assert gateway.app[RUNNER_KEY].tool_parser == "qwen3_coder"


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_chat_reasoning_content_and_xml_tool_call(gateway, scripted, renderer,
                                                               session, clients, stream):
    client = clients("openai")
    script(scripted, renderer, COMPLETION)
    if stream:
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model="m", messages=ASK, tools=OPENAI_TOOLS, stream=True)]
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        calls = [call for d in deltas for call in d.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = await client.chat.completions.create(model="m", messages=ASK,
                                                     tools=OPENAI_TOOLS)
        message = reply.choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
        calls, finish = message.tool_calls, reply.choices[0].finish_reason
    assert reasoning == "I should list the files."
    assert content == "Listing."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("bash", ARGUMENTS)]
    assert finish == "tool_calls"
    assert last_prompt(gateway, scripted, renderer, session).endswith(
        "<|im_start|>assistant\n<think>\n")


async def test_template_kwargs_and_reasoning_effort_reach_the_template(
        gateway, scripted, renderer, session, clients):
    client = clients("openai")
    script(scripted, renderer, "Plain answer.")
    reply = await client.chat.completions.create(
        model="m", messages=ASK, reasoning_effort="high",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].message.content == "Plain answer."
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
    prompt = last_prompt(gateway, scripted, renderer, session)
    assert prompt.startswith("<|im_start|>system\nReasoning: high<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_thinking_blocks(gateway, scripted, renderer, session, clients,
                                         stream):
    client = clients("anthropic")
    script(scripted, renderer, COMPLETION)
    request = {"model": "m", "max_tokens": 200, "messages": ASK, "tools": ANTHROPIC_TOOLS,
               "thinking": {"type": "enabled", "budget_tokens": 100}}
    if stream:
        async with client.messages.stream(**request) as events:
            kinds = [event.type async for event in events]
            message = await events.get_final_message()
        assert "thinking" in kinds  # thinking_delta events, as Anthropic streams them
    else:
        message = await client.messages.create(**request)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "I should list the files."
    assert message.content[1].text == "Listing."
    assert (message.content[2].name, message.content[2].input) == ("bash", ARGUMENTS)
    assert message.stop_reason == "tool_use"

    script(scripted, renderer, "No thinking.")
    reply = await client.messages.create(**{**request, "thinking": {"type": "disabled"}})
    assert [block.type for block in reply.content] == ["text"]
    assert last_prompt(gateway, scripted, renderer, session).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_reasoning_items(gateway, scripted, renderer, session, clients, stream):
    client = clients("openai")
    script(scripted, renderer, COMPLETION)
    request = {"model": "m", "input": "list files", "reasoning": {"effort": "low"},
               "tools": [{"type": "function", **TOOL}], "store": False}
    if stream:
        events = [event async for event in await client.responses.create(**request,
                                                                        stream=True)]
        deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
        assert "".join(deltas) == "I should list the files."
        response = events[-1].response
    else:
        response = await client.responses.create(**request)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response.output[0].summary[0].text == "I should list the files."
    assert response.output[1].content[0].text == "Listing."
    assert json.loads(response.output[2].arguments) == ARGUMENTS
    assert "Reasoning: low" in last_prompt(gateway, scripted, renderer, session)


async def test_a_malformed_call_is_text_and_counted(gateway, scripted, renderer, clients):
    client = clients("openai")
    broken = ("Thinking.\n</think>\n\n<tool_call>\n<function=bash>\n<parameter=cmd>\nls\n"
              "</parameter>\n</function>\nstray words\n</tool_call>")
    script(scripted, renderer, broken)
    reply = await client.chat.completions.create(model="m", messages=ASK, tools=OPENAI_TOOLS)
    message = reply.choices[0].message
    assert message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert message.content == broken.split("</think>\n\n")[1]
    assert gateway.app[METRICS_KEY].unparsed_tool_calls.value(parser="qwen3_coder") == 1
    async with gateway.http.get(f"{gateway.url}/metrics",
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as page:
        assert 'undertow_unparsed_tool_calls_total{parser="qwen3_coder"} 1' in (
            await page.text())


@pytest.mark.parametrize(("extra", "param"), [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"chat_template_kwargs": "enable_thinking"}}, "chat_template_kwargs"),
    ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}},
     "chat_template_kwargs"),
])
async def test_bad_template_arguments_are_400s_naming_them(clients, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        await clients("openai").chat.completions.create(model="m", messages=ASK, **extra)
    assert error.value.body["param"] == param


async def test_bad_anthropic_thinking_is_a_400(clients):
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        await clients("anthropic").messages.create(model="m", max_tokens=10, messages=ASK,
                                                   thinking={"type": "sometimes"})


@pytest.mark.parametrize("forced", [False, True])
async def test_token_truth_survives_a_restart_with_reasoning_and_forced_calls(
        scripted, renderer, thinking_dir, tmp_path, forced):
    """After a restart the stored completion is re-parsed as it was live: inside the think
    block the prompt opened, a forced call as a free one (in the model's own format, the
    reasoning closed first); so the session's next call still extends it by token truth."""
    store_dir = tmp_path / "store"
    completion = COMPLETION.replace("Listing.\n", "") if forced else COMPLETION
    app, runner, url = await start_gateway([scripted.url], thinking_dir, store_dir,
                                           tool_parser="auto")
    try:
        async with aiohttp.ClientSession() as http:
            session = await Gateway(url, app, store_dir, http).open_session(group="restart")
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        script(scripted, renderer, completion)
        first = await client.chat.completions.create(
            model="m", messages=ASK, tools=OPENAI_TOOLS,
            tool_choice="required" if forced else "auto")
        await client.close()
    finally:
        await runner.cleanup()
    assert [json.loads(c.function.arguments) for c in first.choices[0].message.tool_calls] == [
        ARGUMENTS]
    app, runner, url = await start_gateway([scripted.url], thinking_dir, store_dir,
                                           tool_parser="auto")
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session['session_id']}/v1",
                                    api_key=session["api_key"])
        assistant = first.choices[0].message.model_dump(exclude_none=True)
        script(scripted, renderer, "Two files.")
        await client.chat.completions.create(model="m", tools=OPENAI_TOOLS, messages=[
            *ASK, assistant, {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                              "content": "a.py\nb.py"}])
        await client.close()
        tree = app[STORE_KEY].tree("restart")
    finally:
        await runner.cleanup()
    first_call, second_call = (tree.calls[0], tree.calls[1])
    assert second_call.meta["token_truth"] and second_call.branch is None
    assert second_call.meta["extends"] == first_call.call_id


HARMONY_CALL = ("<|channel|>analysis<|message|>I should list the files.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>"
                '{"cmd": "ls -la", "timeout": 30}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Nothing to run.<|end|><|start|>assistant"
                  "<|channel|>final<|message|>Done here.<|return|>")


@pytest.mark.parametrize("stream", [False, True])
async def test_harmony_channels_through_both_sdks(scripted, renderer, tiny_model_dir, tmp_path,
                                                  stream):
    """gpt-oss's layout: the analysis channel is reasoning, a message to functions.NAME a
    tool call, the final channel the answer; the markers are decoded and never leak."""
    model_dir = thinking_model_dir(tiny_model_dir, tmp_path / "harmony", HARMONY)
    app, runner, url = await start_gateway([scripted.url], model_dir, tmp_path / "store",
                                           tool_parser="auto")
    try:
        assert app[RUNNER_KEY].tool_parser == "harmony"
        async with aiohttp.ClientSession() as http:
            session = await Gateway(url, app, tmp_path / "store", http).open_session()
        chat = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        messages = anthropic.AsyncAnthropic(base_url=session["base_url"].removesuffix("/v1"),
                                            api_key=session["api_key"])
        script(scripted, renderer, HARMONY_CALL)
        if stream:
            async with chat.chat.completions.stream(model="m", messages=ASK,
                                                    tools=OPENAI_TOOLS) as events:
                async for _ in events:
                    pass
                reply = await events.get_final_completion()
        else:
            reply = await chat.chat.completions.create(model="m", messages=ASK,
                                                       tools=OPENAI_TOOLS)
        message = reply.choices[0].message
        assert message.model_extra["reasoning_content"] == "I should list the files."
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in message.tool_calls] == [("bash", ARGUMENTS)]
        assert not message.content
        script(scripted, renderer, HARMONY_ANSWER)
        answer = await messages.messages.create(model="m", max_tokens=64, messages=ASK)
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in answer.content] == [("thinking", "Nothing to run."),
                                             ("text", "Done here.")]
        await chat.close()
        await messages.close()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("field", ["mcp_servers", "container"])
async def test_server_side_tools_are_refused_by_name(clients, field):
    value = [{"type": "url", "url": "https://example.invalid", "name": "x"}] if (
        field == "mcp_servers") else "container_1"
    with pytest.raises(anthropic.BadRequestError, match=field):
        await clients("anthropic").messages.create(model="m", max_tokens=10, messages=ASK,
                                                   extra_body={field: value})
