"""Token truth survives a gateway restart: after the gateway stops and a new one
replays the same store, a session's next call extends its last call's prompt and
completion IDs verbatim (no full render, no branch), tool calls included."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.test_api_scripted import OPENAI_TOOLS, TOOL_TEXT, script
from undertow.gateway.app import STORE_KEY

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
        tree = app[STORE_KEY].trees["restart"]
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
