"""Token truth survives a gateway restart: after the gateway stops and a new one
replays the same store, a session's next call extends its last call's prompt and
completion IDs verbatim (no full render, no branch), tool calls included, and its heads
keep the order their calls started in (which labels read)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.test_api_scripted import OPENAI_TOOLS, TOOL_TEXT, script
from tests.gateway.test_calls import LONG, SHORT, conversations
from undertow.gateway.front.app import STORE_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def chat(session: dict, base_url: str, messages: list[dict]):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=session["api_key"])
    try:
        return await client.chat.completions.create(model="m", messages=messages,
                                                    tools=OPENAI_TOOLS)
    finally:
        await client.close()


async def open_session(url: str, group: str) -> dict:
    async with aiohttp.ClientSession() as http, http.post(
            f"{url}/admin/sessions", json={"group": group},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as reply:
        assert reply.status == 201, await reply.text()
        return await reply.json()


async def test_token_truth_resumes_after_restart(scripted, renderer, tiny_model_dir, tmp_path):
    store_dir = tmp_path / "store"
    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        session = await open_session(url, "restart")
        messages = [{"role": "user", "content": "list the files"}]
        script(scripted, renderer, TOOL_TEXT)
        first = await chat(session, session["base_url"], messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id,
                      "content": "a.py\nb.py"}]
        script(scripted, renderer, "Two files.")
        second = await chat(session, session["base_url"], messages)
    finally:
        await runner.cleanup()

    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        messages += [second.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "now read a.py"}]
        script(scripted, renderer, "Reading it.")
        await chat(session, f"{url}/s/{session['session_id']}/v1", messages)
        tree = app[STORE_KEY].tree("restart")
    finally:
        await runner.cleanup()
    call_ids = calls_of(tree, session["session_id"])
    assert len(call_ids) == 3
    middle, last = captured(tree, call_ids[1]), captured(tree, call_ids[2])
    assert middle.meta["extends"] == call_ids[0]  # the tool-call turn, before the restart
    assert last.meta["token_truth"] and last.meta["extends"] == call_ids[1]
    assert last.branch is None
    assert last.prompt_ids[:len(middle.prompt_ids) + len(middle.completion_ids)] == (
        middle.prompt_ids + middle.completion_ids)
    assert last.prompt_ids == scripted.sent[call_ids[2]].input_ids
    assert not any(len(node.children) > 1 for node in tree.nodes.values())


async def test_a_reply_cut_at_a_stop_string_keeps_token_truth_after_restart(
        scripted, renderer, tiny_model_dir, tmp_path):
    """The engine's completion ends with the stop string (the tree keeps it); the reply,
    and so the history the scaffold sends back, does not. After a restart the head must
    be rebuilt from the reply's text, cut where the live gateway cut it."""
    store_dir = tmp_path / "store"
    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        session = await open_session(url, "stop")
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        messages = [{"role": "user", "content": "count"}]
        script(scripted, renderer, "one two END")
        first = await client.chat.completions.create(model="m", messages=messages,
                                                     stop=["END"])
        await client.close()
    finally:
        await runner.cleanup()
    assert first.choices[0].message.content == "one two "

    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session['session_id']}/v1",
                                    api_key=session["api_key"])
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "go on"}]
        script(scripted, renderer, "three")
        await client.chat.completions.create(model="m", messages=messages, stop=["END"])
        await client.close()
        tree = app[STORE_KEY].tree("stop")
    finally:
        await runner.cleanup()
    before, after = (captured(tree, c) for c in calls_of(tree, session["session_id"]))
    assert after.branch is None and after.meta["token_truth"]
    assert after.prompt_ids[:len(before.prompt_ids) + len(before.completion_ids)] == (
        before.prompt_ids + before.completion_ids)


@pytest.mark.parametrize("restart", [False, True])
async def test_continuing_choice_0_of_n_is_no_rewrite(scripted, renderer, tiny_model_dir,
                                                      tmp_path, restart):
    store_dir = tmp_path / "store"
    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        session = await open_session(url, "many")
        messages = [{"role": "user", "content": "propose a fix"}]
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        for text in ("fix A", "fix B", "fix C"):
            script(scripted, renderer, text)
        reply = await client.chat.completions.create(model="m", messages=messages, n=3)
        await client.close()
        if restart:
            await runner.cleanup()
            app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "apply it"}]
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session['session_id']}/v1",
                                    api_key=session["api_key"])
        script(scripted, renderer, "applied")
        await client.chat.completions.create(model="m", messages=messages)
        await client.close()
        tree = app[STORE_KEY].tree("many")
    finally:
        await runner.cleanup()
    call_ids = calls_of(tree, session["session_id"])
    assert len(call_ids) == 4
    choice_0 = next(c for c in tree.calls if c.call_id == reply.id.removeprefix("chatcmpl-"))
    last = captured(tree, call_ids[-1])
    assert last.branch is None and last.meta["extends"] == choice_0.call_id
    assert last.meta["token_truth"]


async def test_heads_keep_the_order_their_calls_started_in_after_restart(
        scripted, renderer, tiny_model_dir, tmp_path):
    """Two overlapping calls, the one started second finishing first: after a restart
    the next call is labelled as before it (`test_calls.py`'s overlapping labels)."""
    store_dir = tmp_path / "store"
    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    scripted.delay_s = 0.02
    try:
        session = await open_session(url, "overlap")
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
        script(scripted, renderer, LONG)
        script(scripted, renderer, SHORT)
        main = asyncio.create_task(client.chat.completions.create(
            model="m", messages=conversations()["main"]))
        while not scripted.sent:  # main has reached the engine
            await asyncio.sleep(0.005)
        await client.chat.completions.create(model="m", messages=conversations()["side"])
        assert not main.done()
        await main
        await client.close()
    finally:
        await runner.cleanup()
    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        client = openai.AsyncOpenAI(base_url=f"{url}/s/{session['session_id']}/v1",
                                    api_key=session["api_key"])
        script(scripted, renderer, SHORT)
        await client.chat.completions.create(model="m", messages=conversations()["next"])
        await client.close()
        tree = app[STORE_KEY].tree("overlap")
    finally:
        await runner.cleanup()
    main_id, side_id, next_id = list(scripted.sent)
    assert [c.call_id for c in tree.calls] == [side_id, main_id, next_id]  # as they ended
    last = captured(tree, next_id)
    assert last.branch == "subagent" and last.meta["extends"] == main_id
