"""A forced tool call (`tool_choice` required or a named function) is sampled in the
family's own tool-call syntax (issue 36, item 4): the structural tag the gateway sends
(`toolparsers.forced`) lets the model write its call as the family's template writes it,
token by token in the family's real vocabulary, and nothing else; the family's parser reads
it as it reads a free call; and, through the real `openai` SDK, the gateway and the
built-in engine, the forced call's tokens stay in the history with token truth.

The reference for "the family's own syntax" is independent of the code under test: the
completions of `tests/gateway/templates` (written by hand from each template, and checked
by `test_families.py` to round-trip through the real templates and tokenizers)."""

from __future__ import annotations

import itertools
import json

import aiohttp
import openai
import pytest
import xgrammar
from transformers import PreTrainedTokenizerFast

from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.templates import FAMILIES, family_model_dir
from undertow.gateway.front.app import STORE_KEY
from undertow.gateway.front.toolparsers import (
    PARSERS,
    ToolCall,
    create_parser,
    forced_structural_tag,
    reasoning_first,
)
from undertow.gateway.render import Renderer

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}},
         {"type": "function", "function": {
    "name": "read", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
# Where each format's calls begin in a completion (what comes before is content/reasoning).
CALL_STARTS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "glm45": "<tool_call>",
               "deepseek_v3": "<｜tool▁calls▁begin｜>", "kimi_k2": "<|tool_calls_section_begin|>",
               "harmony": "<|channel|>commentary to=", "llama3_json": '{"name"'}
PARSED_FAMILIES = sorted(name for name, family in FAMILIES.items() if family.parser)
OLD_FORCED_TEXT = '[{"name": "bash", "parameters": {"cmd": "ls 0"}}]'  # the JSON list of before


def native_call(family) -> str:
    """The family's tool call as its model writes it, without content or the stop token."""
    text = family.completion(0, True)
    text = text[text.index(CALL_STARTS[family.parser]):]
    for stop in family.stop_tokens:
        if stop != "<|call|>":  # harmony's call ends with it (a stop token there too)
            text = text.removesuffix(stop)
    return text


def grammar_matcher(model_dir, family, structural_tag: str) -> tuple:
    """xgrammar's matcher of the structural tag on the family's tokenizer, as an engine
    builds it, and the ID of the family's first stop token."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    stop_id = tokenizer.convert_tokens_to_ids(family.stop_tokens[0])
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                                   stop_token_ids=[stop_id])
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_structural_tag(
        structural_tag)
    return xgrammar.GrammarMatcher(compiled), stop_id


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("forced-families")
    return {name: family_model_dir(tiny_model_dir, FAMILIES[name], root / name)
            for name in PARSED_FAMILIES}


@pytest.mark.parametrize("name", PARSED_FAMILIES)
def test_a_forced_call_is_the_familys_own_syntax_token_by_token(family_dirs, name):
    family = FAMILIES[name]
    parser = PARSERS[family.parser]
    tag = forced_structural_tag(parser, TOOLS, None)
    call = native_call(family)
    renderer = Renderer(family_dirs[name])
    matcher, stop_id = grammar_matcher(family_dirs[name], family, tag)
    for token_id in renderer.encode(call):  # the family's own tokens, markers included
        assert matcher.accept_token(token_id), (name, renderer.decode([token_id], False))
    assert matcher.accept_token(stop_id) and matcher.is_terminated()

    reader = create_parser(family.parser, tools=TOOLS)
    assert reader.feed(call) + reader.finish() == [ToolCall("bash", {"cmd": "ls 0"})]

    grammar = xgrammar.Grammar.from_structural_tag(tag)
    for wrong in (OLD_FORCED_TEXT, "Running it." + call, ""):
        assert not xgrammar.testing._is_grammar_accept_string(grammar, wrong), (name, wrong)


@pytest.mark.parametrize("name", ["qwen25", "qwen3_coder", "deepseek", "glm45", "kimi_k2"])
def test_a_named_or_single_forced_call_allows_only_that(name):
    family = FAMILIES[name]
    parser = PARSERS[family.parser]
    call = native_call(family)
    named = xgrammar.Grammar.from_structural_tag(forced_structural_tag(parser, TOOLS, "read"))
    assert not xgrammar.testing._is_grammar_accept_string(named, call)  # a call to bash
    read_call = call.replace("bash", "read").replace("cmd", "path")
    assert xgrammar.testing._is_grammar_accept_string(named, read_call)
    parallel = xgrammar.Grammar.from_structural_tag(forced_structural_tag(parser, TOOLS, None))
    single = xgrammar.Grammar.from_structural_tag(forced_structural_tag(parser, TOOLS, None,
                                                                        parallel=False))
    if name == "kimi_k2":  # the calls are inside one section
        two = call.replace("<|tool_calls_section_end|>", "") + call.replace(
            "<|tool_calls_section_begin|>", "")
    elif name == "deepseek":
        two = call.replace("<｜tool▁calls▁end｜>", "") + call.replace(
            "<｜tool▁calls▁begin｜>", "")
    else:
        two = call + "\n" + call
    assert xgrammar.testing._is_grammar_accept_string(parallel, two)
    assert not xgrammar.testing._is_grammar_accept_string(single, two)


def test_a_completion_that_begins_inside_a_think_block_closes_it_then_calls():
    """GLM-4.7's prompt opens the think block: the forced completion may reason, must close
    the block, then writes the call, which the parser (told the prompt's tail) reads."""
    family = FAMILIES["glm47"]
    parser = create_parser("glm45", tools=TOOLS, prompt_tail="<|assistant|><think>")
    forced = forced_structural_tag(PARSERS["glm45"], TOOLS, None)
    grammar = xgrammar.Grammar.from_structural_tag(reasoning_first(forced, parser))
    completion = family.completion(0, True).removesuffix("<|observation|>")
    assert xgrammar.testing._is_grammar_accept_string(grammar, completion.replace(
        "Running it.", ""))
    assert not xgrammar.testing._is_grammar_accept_string(grammar, native_call(family))
    assert reasoning_first(forced, create_parser("glm45", tools=TOOLS)) == forced
    assert reasoning_first(None, parser) is None
    events = parser.feed(completion.replace("Running it.", "")) + parser.finish()
    assert events[-1] == ToolCall("bash", {"cmd": "ls 0"})


# The families the SDK sessions run on the built-in engine (their templates on the tiny
# tokenizer, markers as text; as `test_families.ENGINE_FAMILIES`, less GLM-4.7, whose prompt
# opens a think block that the random model would never close).
ENGINE_FAMILIES = ("deepseek", "glm45", "llama3", "qwen25", "qwen3", "qwen3_coder")
ENUM_TOOLS = [{"type": "function", "function": {  # bounded arguments: the model is random
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["cmd"],
                   "properties": {"cmd": {"enum": ["ls", "pwd"]}}}}}]


@pytest.fixture(scope="module")
def engine_family_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("forced-engine-families")
    return {name: family_model_dir(tiny_model_dir, FAMILIES[name], root / name,
                                   add_tokens=False) for name in ENGINE_FAMILIES}


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
async def test_a_forced_call_through_the_sdk_is_native_and_keeps_token_truth(
        engine_family_dirs, engine_url, tmp_path, name):
    family = FAMILIES[name]
    app, runner, url = await start_gateway([engine_url], engine_family_dirs[name],
                                           tmp_path / "store", tool_parser="auto")
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"{url}/admin/sessions", json={"group": "forced"},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
            session = await reply.json()
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        messages = [{"role": "user", "content": "List the files."}]
        try:
            reply = await client.chat.completions.create(
                model="m", messages=messages, tools=ENUM_TOOLS, tool_choice="required",
                max_tokens=400, temperature=0.0)
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls", message
            assert message.tool_calls and all(  # XML values may have a blank around them
                call.function.name == "bash"
                and json.loads(call.function.arguments)["cmd"].strip() in ("ls", "pwd")
                for call in message.tool_calls)
            messages += [message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": call.id, "content": "a.py"}
                         for call in message.tool_calls]
            await client.chat.completions.create(model="m", messages=messages,
                                                 tools=ENUM_TOOLS, max_tokens=4)
        finally:
            await client.close()
        tree = app[STORE_KEY].tree("forced")
    finally:
        await runner.cleanup()
    forced, after = [captured(tree, call_id) for call_id in calls_of(tree,
                                                                     session["session_id"])]
    renderer = Renderer(engine_family_dirs[name])
    sampled = renderer.decode(forced.completion_ids, False)
    assert sampled.startswith(CALL_STARTS[family.parser]), (name, sampled)
    for before, later in itertools.pairwise([forced, after]):
        assert later.branch is None and later.meta["token_truth"], name
        assert later.prompt_ids[:len(before.prompt_ids) + len(before.completion_ids)] == (
            before.prompt_ids + before.completion_ids)
