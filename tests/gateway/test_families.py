"""Token truth with every family's own chat template and tokenizer
(`tests/gateway/templates/`: which are real and which still fixtures, and why): a 30-turn
agent session with tools, reasoning, tool results and user-turn observations, its history
re-sent verbatim or with reasoning stripped, gets every later prompt as the previous
prompt + the sampled IDs verbatim + the new messages as the template renders them after
that history: no call labelled `rewrite`, no token re-tokenized.

The session runs through the pieces a call at the gateway runs through (the OpenAI
messages parsed as the gateway parses them, `build_prompt`, the family's tool parser,
the tree, `Session.add_head`), with the family's tokenizer and its completions in its own
output format tokenized by it, and no engine; then, for the families of `ENGINE_FAMILIES`
(the real templates on the tiny model's tokenizer), through the real `openai` and
`anthropic` clients, the gateway and the built-in engine."""

from __future__ import annotations

import itertools
import json

import aiohttp
import anthropic
import openai
import pytest

from tests.adapters.conftest import bundled_tasks, connection, start_scripted_engine  # noqa: F401
from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.templates import FAMILIES, family_model_dir
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.adapters.mini_swe_agent import MiniSweAgent
from undertow.adapters.rollout import Rollout, RolloutConfig
from undertow.gateway.engines.scripted import ScriptedEngine
from undertow.gateway.front.api.openai_chat import parse_messages
from undertow.gateway.front.app import STORE_KEY
from undertow.gateway.front.head_replay import message_of_events
from undertow.gateway.front.sessions import Session
from undertow.gateway.front.tokentruth import Head, build_prompt
from undertow.gateway.front.toolparsers import PARSERS, create_parser, parser_of_template
from undertow.gateway.render import Renderer, TemplateError
from undertow.gateway.trees.tree import Tree, tree_from_json
from undertow.run.embedded import serve_gateway

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
NUM_TURNS = 30
# The families the SDK sessions on an engine run (one per template kind, as many as
# before the real templates came: the cost of those tests stays what it was). Not gpt-oss:
# on the tiny tokenizer its `<|return|>` is text, not the special stop token its template
# swaps for `<|end|>` once messages follow, so after an answer the history differs from
# the render and the call is a rewrite (with its real tokenizer it holds: above).
ENGINE_FAMILIES = ("deepseek", "glm45", "glm47", "llama3", "qwen25", "qwen3", "qwen3_coder")


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: family_model_dir(tiny_model_dir, family, root / name)
            for name, family in FAMILIES.items()}


def sample(renderer: Renderer, family, prompt_ids: list[int], turn: int, call: bool):
    """What the family's model 'samples' at this turn, and the message the gateway returns
    for it (parsed as `CallRunner` parses: the family's parser, the prompt's tail)."""
    completion = renderer.encode(family.completion(turn, call))
    parser_name = family.parser or "hermes"  # answers only: no tool call to parse
    parser_class = PARSERS[parser_name]
    parser = create_parser(parser_name, tools=TOOLS,
                           prompt_tail=renderer.decode(prompt_ids[-8:], False))
    text = renderer.decode(completion, not parser_class.keeps_special_tokens)
    events = parser.feed(text) + parser.finish()
    return completion, message_of_events(events, lambda: f"call_{turn}")


def resent(message: dict, strip_reasoning: bool) -> dict:
    """The assistant message as a scaffold sends it back (JSON round trip; reasoning
    dropped as Codex and Claude Code drop it)."""
    message = json.loads(json.dumps(message))
    if strip_reasoning:
        message.pop("reasoning_content", None)
    return message


def run_session(renderer: Renderer, family, strip_reasoning: bool):
    """Yields (prompt, previous prompt IDs + completion, messages sent) for every call."""
    tree, session = Tree("g"), Session("s", "g", "k", 0.0)
    messages = [{"role": "system", "content": "You fix bugs."},
                {"role": "user", "content": "The tests fail; fix them."}]
    previous = None
    for turn in range(NUM_TURNS):
        parsed = parse_messages(messages)  # as the gateway gives them to the template
        prompt = build_prompt(renderer, parsed, TOOLS, session.heads, tree.path_token_ids)
        yield prompt, previous, parsed
        # two tool calls, then an answer and a user observation (answers only for a
        # family whose tool-call format the gateway has no parser for)
        call = family.parser is not None and turn % 3 != 2
        completion, message = sample(renderer, family, prompt.token_ids, turn, call)
        if call:
            assert message.get("tool_calls"), (family.name, message)
        tree.add_call(f"c{turn}", "s", prompt.token_ids, completion, [-0.5] * len(completion),
                      [0] * len(completion), branch=prompt.branch)
        previous = prompt.token_ids + completion
        session.add_head(Head(f"c{turn}", prompt.message_keys, prompt.tools_key, message,
                              tree.calls[-1].leaf, len(prompt.token_ids),
                              renderer.closing_text(completion), prompt.messages,
                              next_turn_start=renderer.next_turn_start(completion)), 16)
        messages = [*messages, resent(message, strip_reasoning)]
        if call:
            messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                             "content": f"file_{turn}.py"})
        else:
            messages.append({"role": "user", "content": f"Observation {turn}: 2 tests fail."})


@pytest.mark.parametrize("strip_reasoning", [False, True], ids=["verbatim", "stripped"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_30_turn_session_extends_every_prompt_verbatim(family_dirs, name, strip_reasoning):
    family = FAMILIES[name]
    renderer = Renderer(family_dirs[name])
    assert parser_of_template(family.template) == (family.parser or "hermes")
    num_calls = 0
    for prompt, previous, sent in run_session(renderer, family, strip_reasoning):
        num_calls += 1
        if previous is None:
            assert prompt.branch is None
            continue
        assert prompt.branch is None and prompt.token_truth, (name, len(sent))
        assert prompt.token_ids[:len(previous)] == previous  # sampled IDs verbatim
        added = renderer.decode(prompt.token_ids[len(previous):], False)
        full = renderer.render(sent, TOOLS, add_generation_prompt=True)
        suffix = added[len(renderer.closing_text(previous)):] if added else added
        # the new messages as the template renders them after this history
        assert full.endswith(suffix), (name, added, full[-300:])
        before = full[:len(full) - len(suffix)]
        last_new = sent[-1]["content"]
        assert last_new in suffix and last_new not in before
        assert renderer.encode(added) == prompt.token_ids[len(previous):]
        stop = renderer.sampled_stop_text(previous)
        if stop != "<|return|>":  # the one stop token the template writes otherwise
            assert full.endswith(stop + added), (name, stop, added)  # not twice, not lost
    assert num_calls == NUM_TURNS


def test_a_templates_own_error_is_a_bad_request_and_parsed_messages_avoid_it(family_dirs):
    """gpt-oss's real template tests `"..." in message.content`: an assistant tool call
    with null content fails inside it with a TypeError, which the renderer reports as a
    `TemplateError` (a 400 naming it); the gateway's parsed messages (content a string,
    as `parse_messages` gives every template) render."""
    renderer = Renderer(family_dirs["harmony"])
    call = {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    messages = [{"role": "user", "content": "u"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    with pytest.raises(TemplateError, match="TypeError"):
        renderer.render(messages, TOOLS)
    assert "to=functions.bash" in renderer.render(parse_messages(messages), TOOLS)


@pytest.fixture(scope="module")
def engine_family_dirs(tiny_model_dir, tmp_path_factory):
    """The families' templates on the tiny model's own tokenizer (the built-in engine has
    no embedding for added tokens): their markers are plain text there."""
    root = tmp_path_factory.mktemp("engine-families")
    return {name: family_model_dir(tiny_model_dir, FAMILIES[name], root / name,
                                   add_tokens=False) for name in ENGINE_FAMILIES}


async def openai_turns(session: dict, num_turns: int, strip_reasoning: bool) -> None:
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages = [{"role": "system", "content": "You fix bugs."},
                {"role": "user", "content": "The tests fail; fix them."}]
    try:
        for turn in range(num_turns):
            reply = await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS, max_tokens=6, temperature=0.0)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(resent(message, strip_reasoning))
            if message.get("tool_calls"):
                messages += [{"role": "tool", "tool_call_id": call["id"], "content": "ok"}
                             for call in message["tool_calls"]]
            else:
                messages.append({"role": "user", "content": f"Observation {turn}: it fails."})
    finally:
        await client.close()


async def anthropic_turns(session: dict, num_turns: int, strip_reasoning: bool) -> None:
    client = anthropic.AsyncAnthropic(base_url=session["base_url"].removesuffix("/v1"),
                                      api_key=session["api_key"])
    tools = [{"name": "bash", "description": "Run a shell command",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    messages = [{"role": "user", "content": "The tests fail; fix them."}]
    try:
        for turn in range(num_turns):
            reply = await client.messages.create(model="m", system="You fix bugs.",
                                                 messages=messages, tools=tools, max_tokens=6)
            blocks = [block.model_dump(exclude_none=True) for block in reply.content
                      if not (strip_reasoning and block.type == "thinking")]
            messages.append({"role": "assistant", "content": blocks})
            uses = [block for block in reply.content if block.type == "tool_use"]
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "ok"} for use in uses
            ] or f"Observation {turn}: it fails."})
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("client", ["openai", "anthropic"])
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
async def test_sessions_through_the_sdks_on_the_builtin_engine_keep_token_truth(
        engine_family_dirs, engine_url, tmp_path, name, client):
    """The same kind of session through the real SDKs, the gateway and the built-in engine
    (random weights: whatever it samples is returned, re-sent and extended)."""
    await check_sdk_session(engine_url, engine_family_dirs[name], tmp_path, name, client)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("client", ["openai", "anthropic"])
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
async def test_sessions_through_the_sdks_on_vllm_keep_token_truth(
        engine_family_dirs, vllm_engine_url, tmp_path, name, client):
    """The same, against vLLM's CPU build serving the tiny model (the `vllm+` driver)."""
    await check_sdk_session(f"vllm+{vllm_engine_url}", engine_family_dirs[name], tmp_path,
                            name, client)


async def check_sdk_session(engine: str, model_dir, tmp_path, name: str, client: str) -> None:
    app, runner, url = await start_gateway([engine], model_dir, tmp_path / "store",
                                           tool_parser="auto")
    try:
        async with aiohttp.ClientSession() as http, http.post(
                f"{url}/admin/sessions", json={"group": "fam"},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
            session = await reply.json()
        turns = openai_turns if client == "openai" else anthropic_turns
        await turns(session, NUM_TURNS, strip_reasoning=client == "anthropic")
        tree = app[STORE_KEY].tree("fam")
    finally:
        await runner.cleanup()
    calls = [captured(tree, call_id) for call_id in calls_of(tree, session["session_id"])]
    assert len(calls) == NUM_TURNS
    for before, after in itertools.pairwise(calls):
        assert after.branch is None and after.meta["token_truth"], (name, client)
        extended = before.prompt_ids + before.completion_ids
        assert after.prompt_ids[:len(extended)] == extended


@pytest.mark.docker
@pytest.mark.agents
@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("name", ["qwen3", "qwen3_coder", "glm45"])
async def test_mini_swe_agent_on_a_family_template_keeps_token_truth(
        engine_family_dirs, bundled_tasks, connection, tmp_path, name):  # noqa: F811
    """The real mini-swe-agent (its history as it re-sends it, tool results as tool
    messages) through a gateway on the family's template, a scripted engine replaying
    the oracle trajectory of `test_mini_swe_agent.py` in the family's tool-call format
    (with reasoning where the family writes it): every later call extends the previous
    prompt + sampled IDs, and the session still solves the task."""
    family, task = FAMILIES[name], bundled_tasks[MINI_TASK]
    renderer = Renderer(engine_family_dirs[name])
    scripts = [renderer.encode(_family_turn(name, thought, command)) + [2]
               for thought, command in oracle_steps(task)]
    engine = ScriptedEngine(default=renderer.encode("No tool call here.") + [2],
                            stop_token_ids=(2,))
    engine.scripts = [list(script) for script in scripts]
    engine_runner, engine_url = await start_scripted_engine(engine)
    try:
        async with (serve_gateway(engine_family_dirs[name], tmp_path / "store", [engine_url],
                                  tool_parser="auto") as gateway,
                    GatewayAdmin(gateway.url, gateway.admin_token) as admin):
            config = RolloutConfig(group_size=1, concurrency=1, timeout_s=300,
                                   out_dir=tmp_path, progress_interval_s=0)
            summary = await Rollout([task], MiniSweAgent(step_limit=6), admin, connection,
                                    config).run()
            [result] = summary.sessions
            tree = tree_from_json(await admin.session_tree(result.session_id))
    finally:
        await engine_runner.cleanup()
    assert result.reward == 1.0, (family.name, result)
    calls = [captured(tree, call.call_id) for call in tree.calls]
    assert len(calls) == len(scripts)
    for before, after in itertools.pairwise(calls):
        assert after.branch is None and after.meta["token_truth"], name
        extended = before.prompt_ids + before.completion_ids
        assert after.prompt_ids[:len(extended)] == extended


MINI_TASK = "calclang__calclang-2"


def oracle_steps(task) -> list[tuple[str, str]]:
    return [("Let me look at how powers are parsed.",
             "grep -n 'def power' -A 5 calclang/parser.py"),
            ("`**` must be right-associative and take a unary exponent.",
             f"git apply <<'UNDERTOW_PATCH'\n{task.patch}UNDERTOW_PATCH"),
            ("The fix is in place; submitting.",
             "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff")]


def _family_turn(name: str, thought: str, command: str) -> str:
    arguments = json.dumps({"command": command})
    if name == "qwen3":
        return (f"<think>\n{thought}\n</think>\n\nTHOUGHT: {thought}\n<tool_call>\n"
                f'{{"name": "bash", "arguments": {arguments}}}\n</tool_call>')
    if name == "qwen3_coder":
        return (f"THOUGHT: {thought}\n<tool_call>\n<function=bash>\n<parameter=command>\n"
                f"{command}\n</parameter>\n</function>\n</tool_call>")
    return (f"\n<think>{thought}</think>\nTHOUGHT: {thought}\n<tool_call>bash\n"
            f"<arg_key>command</arg_key>\n<arg_value>{command}</arg_value>\n</tool_call>")
