"""Rendering and token truth on the tiny model's real tokenizer and chat template."""

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.templates import FAMILIES, family_model_dir
from undertow.gateway.engine_pool.pool import EnginePool
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams, TokenIdsJson
from undertow.gateway.engines.sglang import sglang_body, sglang_body_pieces
from undertow.gateway.front.app import STORE_KEY, create_app
from undertow.gateway.front.config import GatewayConfig
from undertow.gateway.front.sessions import Session
from undertow.gateway.front.tokentruth import (
    RETRY,
    REWRITE,
    SUBAGENT,
    Head,
    build_prompt,
    message_key,
)
from undertow.gateway.render import Detokenizer, Renderer
from undertow.gateway.trees.tree import Tree

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(tiny_model_dir)


def record(renderer, tree, heads, messages, completion_text, assistant, tools=None):
    """Builds the prompt like the runner does, 'samples' `completion_text`, records it."""
    prompt = build_prompt(renderer, messages, tools, heads, tree.path_token_ids)
    completion = renderer.encode(completion_text) + [renderer.tokenizer.token_to_id("<|im_end|>")]
    tree.add_call(f"c{len(tree.calls)}", "s", prompt.token_ids, completion,
                  [-0.5] * len(completion), [0] * len(completion), branch=prompt.branch)
    heads.append(Head(f"c{len(tree.calls) - 1}", prompt.message_keys, prompt.tools_key,
                      assistant, tree.calls[-1].leaf, len(prompt.token_ids),
                      renderer.closing_text(completion)))
    return prompt, completion


def test_template_matches_full_render_and_turn_end(renderer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = renderer.render(messages, TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief")
    assert "<tools>" in text and text.endswith("<|im_start|>assistant\n")
    assert renderer.turn_end == "<|im_end|>\n"


def test_second_call_extends_first_prompt_and_completion_verbatim(renderer):
    tree, heads = Tree("g"), []
    first = [{"role": "user", "content": "list files"}]
    # A completion whose re-tokenization differs from the sampled IDs would be lost
    # by a full render; sample an unusual split on purpose.
    odd = renderer.encode("I wi") + renderer.encode("ll run ls.")
    p1 = build_prompt(renderer, first, TOOLS, heads, tree.path_token_ids)
    completion = odd + [renderer.tokenizer.token_to_id("<|im_end|>")]
    tree.add_call("c0", "s", p1.token_ids, completion, [-1.0] * len(completion),
                  [0] * len(completion))
    assistant = {"role": "assistant", "content": "I will run ls."}
    heads.append(Head("c0", p1.message_keys, p1.tools_key, assistant, tree.calls[-1].leaf,
                      len(p1.token_ids), renderer.closing_text(completion)))
    second = [*first, {"role": "assistant", "content": "I will run ls."},
              {"role": "user", "content": "go on"}]
    p2 = build_prompt(renderer, second, TOOLS, heads, tree.path_token_ids)
    assert p2.token_truth and p2.branch is None
    assert p2.token_ids[:len(p1.token_ids) + len(completion)] == p1.token_ids + completion
    suffix = renderer.decode(p2.token_ids[len(p1.token_ids) + len(completion):],
                             skip_special_tokens=False)
    assert suffix == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    full = renderer.encode(renderer.render(second, TOOLS, add_generation_prompt=True))
    assert full != p2.token_ids  # the full render would have re-tokenized the completion


def test_tool_calls_resent_with_reserialized_arguments_still_extend(renderer):
    tree, heads = Tree("g"), []
    first = [{"role": "user", "content": "go"}]
    text = '<tool_call>\n{"name": "bash", "arguments": {"cmd":"ls"}}\n</tool_call>'
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}
    p1, completion = record(renderer, tree, heads, first, text, assistant, TOOLS)
    resent = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "bash",
                                                         "arguments": '{ "cmd" : "ls" }'}}]}
    second = [*first, resent, {"role": "tool", "tool_call_id": "other", "content": "a.py"}]
    p2 = build_prompt(renderer, second, TOOLS, heads, tree.path_token_ids)
    assert p2.token_truth
    assert p2.token_ids[:len(p1.token_ids) + len(completion)] == p1.token_ids + completion
    assert "<tool_response>\na.py\n</tool_response>" in renderer.decode(
        p2.token_ids[len(p1.token_ids):], skip_special_tokens=False)


def test_rewrite_retry_and_subagent_are_labelled(renderer):
    tree, heads = Tree("g"), []
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    record(renderer, tree, heads, first, "ok", {"role": "assistant", "content": "ok"})
    retried = build_prompt(renderer, first, None, heads, tree.path_token_ids)
    assert retried.branch == RETRY
    assert retried.token_ids == tree.path_token_ids(heads[0].leaf)[:heads[0].num_prompt_tokens]
    edited = [*first, {"role": "assistant", "content": "changed"}, {"role": "user", "content": "x"}]
    assert build_prompt(renderer, edited, None, heads, tree.path_token_ids).branch == REWRITE
    other = [{"role": "system", "content": "you are a sub-agent"}, {"role": "user", "content": "y"}]
    assert build_prompt(renderer, other, None, heads, tree.path_token_ids).branch == SUBAGENT
    assert build_prompt(renderer, first, None, [], tree.path_token_ids).branch is None


def test_truncated_completion_is_closed_with_turn_end(renderer):
    tree, heads = Tree("g"), []
    first = [{"role": "user", "content": "a"}]
    prompt = build_prompt(renderer, first, None, heads, tree.path_token_ids)
    completion = renderer.encode("cut off mid")  # finish_reason length: no <|im_end|>
    tree.add_call("c0", "s", prompt.token_ids, completion, [0.0] * len(completion),
                  [0] * len(completion))
    heads.append(Head("c0", prompt.message_keys, prompt.tools_key,
                      {"role": "assistant", "content": "cut off mid"}, tree.calls[-1].leaf,
                      len(prompt.token_ids), renderer.closing_text(completion)))
    second = [*first, {"role": "assistant", "content": "cut off mid"},
              {"role": "user", "content": "b"}]
    p2 = build_prompt(renderer, second, None, heads, tree.path_token_ids)
    tail = renderer.decode(p2.token_ids[len(prompt.token_ids) + len(completion):],
                           skip_special_tokens=False)
    assert tail.startswith("<|im_end|>\n<|im_start|>user\nb")


def test_detokenizer_streams_the_same_text_as_a_full_decode(renderer):
    text = "héllo wörld — ünïcode ✓ and <tool_call> tags 你好"
    token_ids = renderer.encode(text)
    detokenizer = Detokenizer(renderer)
    pieces = [detokenizer.push([token_id]) for token_id in token_ids]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == renderer.decode(token_ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


def record_like_runner(renderer, tree, heads, messages, completion_text, sessions_head):
    """`record`, keeping the head's messages and IDs' JSON as `CallRunner` does."""
    prompt = build_prompt(renderer, messages, None, heads, tree.path_token_ids)
    completion = renderer.encode(completion_text) + [renderer.tokenizer.token_to_id("<|im_end|>")]
    tree.add_call(f"c{len(tree.calls)}", "s", prompt.token_ids, completion,
                  [-0.5] * len(completion), [0] * len(completion), branch=prompt.branch)
    sessions_head(Head(f"c{len(tree.calls) - 1}", prompt.message_keys, prompt.tools_key,
                       {"role": "assistant", "content": completion_text}, tree.calls[-1].leaf,
                       len(prompt.token_ids), renderer.closing_text(completion),
                       prompt.messages, prompt.token_ids_json.extend(completion)))
    return prompt


def test_unchanged_history_takes_the_fast_path_with_the_same_keys_and_json(renderer):
    tree, session = Tree("g"), Session("s", "g", "k", 0.0)

    def add(head):
        session.add_head(head, 4)

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "one"}]
    prompts = [record_like_runner(renderer, tree, session.heads, messages, "first", add)]
    for turn, reply in enumerate(("second", "third")):
        messages = [*messages, {"role": "assistant", "content": ["first", "second"][turn]},
                    {"role": "user", "content": f"more {turn}"}]
        prompts.append(record_like_runner(renderer, tree, session.heads, messages, reply, add))
    # the same conversation re-sent with re-serialised (canonically equal) history
    resent = [dict(message, content=f" {message['content']} ") for message in messages]
    resent += [{"role": "assistant", "content": "third"}, {"role": "user", "content": "end"}]
    prompts.append(build_prompt(renderer, resent, None, session.heads, tree.path_token_ids))
    for prompt in prompts:
        assert orjson.loads(prompt.token_ids_json.to_bytes()) == prompt.token_ids
    assert all(prompt.token_truth and prompt.branch is None for prompt in prompts[1:])
    assert prompts[2].messages[:2] == messages[:2]
    assert prompts[2].messages[0] is prompts[0].messages[0]  # one copy of the history
    assert prompts[-1].message_keys == tuple(message_key(m) for m in resent)
    assert [head.token_ids_json is not None for head in session.heads] == [False, False, True]
    retried = build_prompt(renderer, messages[:2], None, session.heads, tree.path_token_ids)
    assert retried.branch == RETRY
    assert orjson.loads(retried.token_ids_json.to_bytes()) == retried.token_ids


def test_token_ids_json_extends_in_pieces_to_the_arrays_json():
    ids_json, token_ids = TokenIdsJson.of([]), []
    for step in range(3 * TokenIdsJson.MAX_PIECES):
        new_ids = list(range(step % 3))
        ids_json, token_ids = ids_json.extend(new_ids), token_ids + new_ids
        assert len(ids_json.pieces) <= TokenIdsJson.MAX_PIECES
    assert ids_json.to_bytes() == orjson.dumps(token_ids)
    request = GenerateRequest(input_ids=token_ids, input_ids_json=ids_json, rid="r",
                              sampling_params=SamplingParams(sampling_seed=3))
    assert orjson.loads(b"".join(sglang_body_pieces(request, stream=True))) == orjson.loads(
        orjson.dumps(sglang_body(request, stream=True)))


class WatchedPool:
    """The gateway's real engine pool, noting each prompt list it is given (the list
    itself, and a copy of it as it was), so a test can see whether it changed later."""

    def __init__(self, pool):
        self.pool = pool
        self.given: list[tuple[list[int], list[int]]] = []

    async def generate(self, session_id, request, **kwargs):
        self.given.append((request.input_ids, list(request.input_ids)))
        async for chunk in self.pool.generate(session_id, request, **kwargs):
            yield chunk

    def __getattr__(self, name):
        return getattr(self.pool, name)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_prompt_list_the_pool_was_given_never_changes(scripted, tiny_model_dir,
                                                                tmp_path):
    """The pool, its engine requests and a migration hold a call's prompt list as one
    that never changes; token truth must build the next prompt in a list of its own."""
    pool = WatchedPool(EnginePool([scripted.url]))
    await pool.start()
    app = create_app(GatewayConfig(model_dir=tiny_model_dir, store_dir=tmp_path / "store",
                                   admin_token=ADMIN_TOKEN), pool=pool)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"{url}/admin/sessions", json={"group": "g"},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
            session = await reply.json()
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        messages = [{"role": "user", "content": "start"}]
        for turn in range(3):
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"turn {turn}"}]
        await client.close()
    finally:
        await runner.cleanup()
        await pool.close()
    assert len(pool.given) == 3
    for given, as_given in pool.given:
        assert given == as_given
    assert len(pool.given[1][0]) > len(pool.given[0][0])  # the later prompts did extend


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("policy", ["verbatim", "template"])
async def test_token_truth_policies_on_a_template_that_drops_earlier_reasoning(
        scripted, tiny_model_dir, tmp_path, policy):
    """`verbatim` extends the sampled IDs (no branch); `template` sends the template's full
    render every call, and a call whose render departs from the path it continues (the
    Qwen3-like template dropped the reasoning of the turn before) is a `template` branch."""
    family = FAMILIES["qwen3"]
    model_dir = family_model_dir(tiny_model_dir, family, tmp_path / "qwen3", add_tokens=False)
    renderer = Renderer(model_dir)
    app, runner, url = await start_gateway([scripted.url], model_dir, tmp_path / "store",
                                           token_truth=policy)
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"{url}/admin/sessions", json={"group": "g"},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
            session = await reply.json()
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        messages, sent = [{"role": "user", "content": "fix the tests"}], []
        for turn in range(4):
            scripted.scripts.append(renderer.encode(
                f"<think>\nStep {turn}.\n</think>\n\nDone {turn}.") + [2])
            reply = await client.chat.completions.create(model="m", messages=messages)
            sent.append(list(messages))
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": f"still failing {turn}"}]
        await client.close()
        tree = app[STORE_KEY].tree("g")
    finally:
        await runner.cleanup()
    calls = [captured(tree, call_id) for call_id in calls_of(tree, session["session_id"])]
    if policy == "verbatim":
        assert [call.branch for call in calls] == [None] * 4
        assert all(call.meta["token_truth"] for call in calls[1:])
        return
    for call, messages_sent in zip(calls, sent, strict=True):
        assert call.prompt_ids == renderer.encode(
            renderer.render(messages_sent, None, add_generation_prompt=True))
    assert [call.branch for call in calls] == [None, "template", "template", "template"]
