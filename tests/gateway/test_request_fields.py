"""Request fields that earlier were accepted and ignored, through the real `openai` and
`anthropic` clients against a gateway in front of the scripted engine: each one is now
honoured (and the test shows what it changed: the prompt the engine got, the parameters
it was sent, the reply) or refused with a 400 in the API's own error shape that names
it. docs/api.md's "Request fields" tables list every accepted field of each API."""

from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest

from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import Gateway, start_gateway
from tests.gateway.thinking_template import TEMPLATE, thinking_model_dir
from undertow.gateway.errors import BadRequest
from undertow.gateway.front.api.sealed_reasoning import MARKER, seal, unseal

on_loop = pytest.mark.asyncio(loop_scope="session")

# The thinking template (reasoning in <think>, Qwen3-Coder XML calls, `reasoning_effort`
# in a system line), which also takes a `verbosity` argument.
VERBOSE_TEMPLATE = ("{%- if verbosity is defined -%}{{- '<|im_start|>system\\nVerbosity: ' ~ "
                    "verbosity ~ '<|im_end|>\\n' -}}{%- endif -%}" + TEMPLATE)
REASONING = "I should list the files."
COMPLETION = (f"{REASONING}\n</think>\n\nListing.\n<tool_call>\n<function=bash>\n"
              "<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>")
TOOL = {"type": "function", "name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
ASK = [{"role": "user", "content": "list files"}]
ANSWER = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}


@pytest.fixture(scope="module")
def verbose_dir(tiny_model_dir, tmp_path_factory):
    return thinking_model_dir(tiny_model_dir, tmp_path_factory.mktemp("verbose") / "model",
                              VERBOSE_TEMPLATE)


@pytest.fixture
async def thinking_gateway(scripted, verbose_dir, tmp_path):
    app, runner, url = await start_gateway([scripted.url], verbose_dir, tmp_path / "store",
                                           tool_parser="auto")
    async with aiohttp.ClientSession() as http:
        yield Gateway(url, app, tmp_path / "store", http)
    await runner.cleanup()


@pytest.fixture
async def clients():
    """`await clients(gateway)`: a new session's openai and anthropic clients."""
    made = []

    async def make(gateway: Gateway):
        session = await gateway.open_session()
        made.append(openai.AsyncOpenAI(base_url=session["base_url"],
                                       api_key=session["api_key"], max_retries=0))
        made.append(anthropic.AsyncAnthropic(base_url=session["base_url"].removesuffix("/v1"),
                                             api_key=session["api_key"], max_retries=0))
        return session, made[-2], made[-1]

    yield make
    for client in made:
        await client.close()


def script(scripted, renderer, text: str) -> None:
    scripted.scripts.append(renderer.encode(text) + [2])


def last_call(gateway: Gateway, scripted, renderer, session: dict) -> tuple:
    """The session's newest call as recorded, and its prompt as the engine got it (text)."""
    call_id = calls_of(gateway.tree(), session["session_id"])[-1]
    prompt = renderer.decode(scripted.sent[call_id].input_ids, skip_special_tokens=False)
    return captured(gateway.tree(), call_id), prompt, scripted.sent[call_id].sampling_params


def test_sealed_reasoning_reads_back_exactly_and_refuses_what_it_did_not_seal():
    text = "Plan: grep for \u00e9t\u00e9 \U0001f600, then run the tests.\n" * 20
    sealed = seal(text)
    assert sealed.startswith(MARKER) and text not in sealed
    assert unseal(sealed, "input[1].encrypted_content") == text
    for foreign in ("gAAAAABoOpaqueCiphertextOfAnotherProvider", MARKER + "not*base64"):
        with pytest.raises(BadRequest) as error:
            unseal(foreign, "input[1].encrypted_content")
        assert error.value.param == "input[1].encrypted_content"


@on_loop
@pytest.mark.parametrize(("stream", "summary"), [(False, "auto"), (True, "none")])
async def test_encrypted_reasoning_is_returned_and_read_back_with_token_truth(
        thinking_gateway, scripted, renderer, clients, stream, summary):
    session, client, _ = await clients(thinking_gateway)
    script(scripted, renderer, COMPLETION)
    request = {"model": "m", "input": ASK, "tools": [TOOL], "store": False,
               "include": ["reasoning.encrypted_content"], "reasoning": {"summary": summary}}
    if stream:
        events = [event async for event in await client.responses.create(**request,
                                                                          stream=True)]
        output = events[-1].response.output
        # No summary asked for: no summary events either.
        assert not any(event.type.startswith("response.reasoning_summary") for event in events)
    else:
        output = (await client.responses.create(**request)).output
    reasoning, _, call = output
    assert unseal(reasoning.encrypted_content, "x") == REASONING
    assert [part.text for part in reasoning.summary] == ([] if summary == "none" else
                                                         [REASONING])
    # Sent back as Codex does, here with the readable summary dropped: the sealed
    # reasoning alone makes the turn the one recorded, so the next call extends it.
    history = [*ASK, {"type": "reasoning", "id": reasoning.id, "summary": [],
                      "encrypted_content": reasoning.encrypted_content},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Listing."}]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}]
    script(scripted, renderer, "Done.\n</think>\n\nOne file.")
    await client.responses.create(**{**request, "input": history})
    [first, second] = [captured(thinking_gateway.tree(), call_id) for call_id in
                       calls_of(thinking_gateway.tree(), session["session_id"])]
    assert second.branch is None and second.meta["token_truth"]
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    # In a new session the history is rendered in full: the reasoning read back is in it.
    fresh, other, _ = await clients(thinking_gateway)
    await other.responses.create(**{**request, "input": history})
    _, prompt, _ = last_call(thinking_gateway, scripted, renderer, fresh)
    assert f"<think>\n{REASONING}\n</think>\n\nListing." in prompt


@on_loop
@pytest.mark.parametrize("stream", [False, True])
async def test_omitted_thinking_is_sealed_in_its_signature_and_read_back(
        thinking_gateway, scripted, renderer, clients, stream):
    session, _, messages = await clients(thinking_gateway)
    script(scripted, renderer, COMPLETION)
    tools = [{"name": "bash", "input_schema": TOOL["parameters"]}]
    request = {"model": "m", "max_tokens": 2048, "messages": ASK, "tools": tools,
               "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}
    if stream:
        async with messages.messages.stream(**request) as events:
            deltas = [event.delta.type async for event in events
                      if event.type == "content_block_delta"]
            reply = await events.get_final_message()
        assert "thinking_delta" not in deltas and "signature_delta" in deltas
    else:
        reply = await messages.messages.create(**request)
    thinking, _, use = reply.content
    assert (thinking.type, thinking.thinking) == ("thinking", "")
    assert unseal(thinking.signature, "x") == REASONING
    history = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in
                                                      reply.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "a.txt"}]}]
    script(scripted, renderer, "Done.\n</think>\n\nOne file.")
    await messages.messages.create(**{**request, "messages": history})
    [first, second] = [captured(thinking_gateway.tree(), call_id) for call_id in
                       calls_of(thinking_gateway.tree(), session["session_id"])]
    assert second.branch is None and second.meta["token_truth"]
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    fresh, _, other = await clients(thinking_gateway)
    await other.messages.create(**{**request, "messages": history})
    _, prompt, _ = last_call(thinking_gateway, scripted, renderer, fresh)
    assert f"<think>\n{REASONING}\n</think>\n\nListing." in prompt


@on_loop
async def test_without_include_reasoning_items_carry_no_encrypted_content(
        thinking_gateway, scripted, renderer, clients):
    _, client, _ = await clients(thinking_gateway)
    script(scripted, renderer, COMPLETION)
    reply = await client.responses.create(model="m", input=ASK, tools=[TOOL])
    assert reply.output[0].type == "reasoning" and reply.output[0].encrypted_content is None


@on_loop
async def test_verbosity_and_effort_reach_a_template_that_reads_them(
        thinking_gateway, scripted, renderer, clients):
    session, client, messages = await clients(thinking_gateway)
    await client.responses.create(model="m", input=ASK, text={"verbosity": "low"},
                                  reasoning={"effort": "minimal"})
    _, prompt, _ = last_call(thinking_gateway, scripted, renderer, session)
    assert prompt.startswith("<|im_start|>system\nVerbosity: low<|im_end|>\n"
                             "<|im_start|>system\nReasoning: minimal<|im_end|>\n")
    await client.chat.completions.create(model="m", messages=ASK, verbosity="high")
    _, prompt, _ = last_call(thinking_gateway, scripted, renderer, session)
    assert prompt.startswith("<|im_start|>system\nVerbosity: high<|im_end|>\n")
    await messages.messages.create(model="m", max_tokens=16, messages=ASK,
                                   output_config={"effort": "max"})
    _, prompt, _ = last_call(thinking_gateway, scripted, renderer, session)
    assert prompt.startswith("<|im_start|>system\nReasoning: max<|im_end|>\n")


@on_loop
async def test_anthropic_output_config_format_is_a_schema_constraint(
        thinking_gateway, scripted, renderer, clients):
    session, _, messages = await clients(thinking_gateway)
    script(scripted, renderer, '\n</think>\n\n{"title": "Listing"}')
    # Claude Code's title call: effort and a JSON schema, no thinking.
    reply = await messages.messages.create(
        model="m", max_tokens=32, messages=ASK,
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": ANSWER}})
    _, prompt, params = last_call(thinking_gateway, scripted, renderer, session)
    assert json.loads(params["json_schema"]) == ANSWER
    assert json.loads(reply.content[-1].text) == {"title": "Listing"}
    assert prompt.startswith("<|im_start|>system\nReasoning: high<|im_end|>\n")


@on_loop
async def test_claude_codes_context_edit_and_the_one_tier_are_accepted(
        gateway, scripted, renderer, clients):
    """What Claude Code 2.1.197 sends with thinking on (keep every thinking block: what
    the gateway does), and service tiers that are the one the gateway has."""
    session, client, messages = await clients(gateway)
    reply = await messages.messages.create(
        model="m", max_tokens=16, messages=ASK, thinking={"type": "adaptive"},
        service_tier="auto", metadata={"user_id": "u"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                      "keep": "all"}]}})
    assert reply.content[0].text == "Hello from the script."
    reply = await client.responses.create(model="m", input=ASK, truncation="disabled",
                                          service_tier="default", stream_options=None)
    assert reply.output_text == "Hello from the script."
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="m", messages=ASK, stream=True, service_tier="auto",
        stream_options={"include_usage": True, "include_obfuscation": False})]
    assert chunks[-1].usage.completion_tokens == len(scripted.default)  # usage: honoured
    # A strict tool in a forced call: sampled under its schema, so strict is honoured.
    script(scripted, renderer,
           '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>')
    reply = await client.chat.completions.create(
        model="m", messages=ASK, tool_choice="required",
        tools=[{"type": "function", "function": {**CHAT_TOOL["function"], "strict": True}}])
    _, _, params = last_call(gateway, scripted, renderer, session)
    [tag] = json.loads(params["structural_tag"])["format"]["tags"]
    assert tag["content"]["json_schema"] == TOOL["parameters"]
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"cmd": "ls"}
    # ... and moot where no call can be made.
    await client.chat.completions.create(
        model="m", messages=ASK, tool_choice="none",
        tools=[{"type": "function", "function": {**CHAT_TOOL["function"], "strict": True}}])
    assert len(calls_of(gateway.tree(), session["session_id"])) == 5


RESPONSES_REFUSED = [
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["web_search_call.results"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),  # the tiny template has none
    ({"text": {"format": {"type": "text"}, "style": "terse"}}, "text.style"),
    ({"reasoning": {"effort": "low", "mode": "deep"}}, "reasoning.mode"),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"extra_body": {"stream_options": {"include_obfuscation": True}}},
     "stream_options.include_obfuscation"),
    ({"tools": [{**TOOL, "strict": True}]}, "tools[0].strict"),  # free tool use
]


@on_loop
async def test_responses_fields_it_cannot_honour_are_400s_naming_them(gateway, clients):
    _, client, _ = await clients(gateway)
    for extra, param in RESPONSES_REFUSED:
        with pytest.raises(openai.BadRequestError) as error:
            await client.responses.create(model="m", input=ASK, **extra)
        assert error.value.body["param"] == param, extra
        assert error.value.body["code"] == "unsupported_parameter", extra


@on_loop
async def test_responses_reasoning_it_did_not_seal_is_a_400_naming_the_item(gateway, clients):
    _, client, _ = await clients(gateway)
    history = [*ASK, {"type": "reasoning", "id": "rs_1", "summary": [],
                      "encrypted_content": "gAAAAABotherProvidersCiphertext"},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi."}]}, *ASK]
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(model="m", input=history)
    assert error.value.body["param"] == "input[1].encrypted_content"


CHAT_REFUSED = [
    ({"extra_body": {"extra_body": {"top_k": 5}}}, "extra_body"),
    ({"verbosity": "low"}, "verbosity"),  # the tiny template has none
    ({"service_tier": "flex"}, "service_tier"),
    ({"stream_options": {"include_obfuscation": True}, "stream": True},
     "stream_options.include_obfuscation"),
    ({"stream_options": {"include_usage": True, "chunk_size": 4}, "stream": True},
     "stream_options.chunk_size"),
    ({"tools": [CHAT_TOOL, {"type": "function", "function": {**CHAT_TOOL["function"],
                                                             "name": "sh", "strict": True}}]},
     "tools[1].function.strict"),
]


@on_loop
async def test_chat_fields_it_cannot_honour_are_400s_naming_them(gateway, clients):
    _, client, _ = await clients(gateway)
    for extra, param in CHAT_REFUSED:
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(model="m", messages=ASK, **extra)
        assert error.value.body["param"] == param, extra
    with pytest.raises(openai.BadRequestError) as error:  # legacy completions alike
        await client.completions.create(model="m", prompt="Once", stream=True,
                                        stream_options={"include_obfuscation": True})
    assert error.value.body["param"] == "stream_options.include_obfuscation"


MESSAGES_REFUSED = [
    ({"extra_body": {"context_management": {"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
                                                         "value": 1000}}]}}},
     "context_management.edits.0"),
    ({"extra_body": {"context_management": {"edits": [{"type": "clear_thinking_20251015"}]}}},
     "context_management.edits.0"),
    ({"output_config": {"effort": "high", "task_budget": 100}}, "output_config.task_budget"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": ANSWER}},
      "extra_body": {"output_format": {"type": "json_schema", "schema": ANSWER}}},
     "output_format"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "hidden"}},
     "thinking.display"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "bash", "input_schema": TOOL["parameters"], "strict": True}]},
     "tools.0.strict"),
]


@on_loop
async def test_messages_fields_it_cannot_honour_are_400s_naming_them(gateway, clients):
    _, _, messages = await clients(gateway)
    for extra, named in MESSAGES_REFUSED:
        with pytest.raises(anthropic.BadRequestError) as error:
            await messages.messages.create(model="m", max_tokens=2048, messages=ASK, **extra)
        assert error.value.body["type"] == "error", extra
        assert error.value.body["error"]["type"] == "invalid_request_error", extra
        assert named in error.value.body["error"]["message"], extra
