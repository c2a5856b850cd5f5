"""A damaged store loses no more than the damage: a gateway written store, damaged by hand
(a truncated record, a garbage line inserted, a token ID changed in valid JSON), sets the
damaged group aside by itself at start-up (named in a warning and in /metrics; the other
groups serve, `trees show` reads them), and `undertow trees repair` keeps every record
that still replays. The repaired tree is compared with a reference built from the engine's
own record of each kept call (`ScriptedEngine.sent`), not from the store."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import aiohttp
import openai
import pytest

from tests.gateway.capture import captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from tests.gateway.test_api_scripted import script
from undertow.gateway.front.app import STORE_KEY
from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import Tree

pytestmark = pytest.mark.asyncio(loop_scope="session")
SESSIONS, TURNS = ("a", "b", "c"), 3
DAMAGED_LINE = 8  # b's call of turn 1: three opens, then the calls a, b, c of each turn


def undertow(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, UNDERTOW_ADMIN_TOKEN=ADMIN_TOKEN)
    return subprocess.run([sys.executable, "-m", "undertow.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False, env=env)


async def admin(http, method: str, url: str, **kwargs) -> dict:
    async with http.request(method, url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                            **kwargs) as reply:
        assert reply.status in (200, 201), await reply.text()
        return await reply.json()


async def chat(session: dict, messages: list, base_url: str | None = None):
    client = openai.AsyncOpenAI(base_url=base_url or session["base_url"],
                                api_key=session["api_key"], max_retries=0)
    try:
        return await client.chat.completions.create(model="m", messages=messages)
    finally:
        await client.close()


async def write_store(scripted, renderer, tiny_model_dir, store_dir) -> tuple[dict, dict]:
    """Group `hurt`: sessions a, b, c sharing a first message, their calls interleaved
    turn by turn, then closed with a reward; group `fine`: one session of one call.
    Returns the sessions by name and each one's call IDs, as an in-process gateway
    (stopped after) recorded them."""
    _, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    sessions, call_ids = {}, {name: [] for name in SESSIONS}
    try:
        async with aiohttp.ClientSession() as http:
            for name in SESSIONS:
                sessions[name] = await admin(http, "POST", f"{url}/admin/sessions",
                                             json={"group": "hurt"})
            sessions["fine"] = await admin(http, "POST", f"{url}/admin/sessions",
                                           json={"group": "fine"})
            messages = {name: [{"role": "user", "content": "fix the bug " * 10}]
                        for name in SESSIONS}
            for turn in range(TURNS):
                for name in SESSIONS:
                    script(scripted, renderer, f"{name} does step {turn}")
                    reply = await chat(sessions[name], messages[name])
                    call_ids[name].append(reply.id.removeprefix("chatcmpl-"))
                    messages[name] += [reply.choices[0].message.model_dump(exclude_none=True),
                                       {"role": "user", "content": f"{name} saw {turn}"}]
            for name in SESSIONS:
                await admin(http, "POST", f"{url}/admin/sessions/"
                            f"{sessions[name]['session_id']}/close", json={"reward": 1.0})
            await chat(sessions["fine"], [{"role": "user", "content": "hello"}])
    finally:
        await runner.cleanup()
    return sessions, call_ids


def damage(log_file, how: str) -> None:
    lines = log_file.read_bytes().split(b"\n")[:-1]
    assert json.loads(lines[DAMAGED_LINE - 1])["session_id"] == json.loads(lines[4])[
        "session_id"]   # b's
    if how == "truncated":
        lines[DAMAGED_LINE - 1] = lines[DAMAGED_LINE - 1][:200]
    elif how == "token changed":   # still valid JSON: only its checksum tells
        lines[DAMAGED_LINE - 1] = re.sub(
            rb'"token_ids":\[(\d+)', lambda m: b'"token_ids":[%d' % (int(m[1]) + 1),
            lines[DAMAGED_LINE - 1], count=1)
    else:
        lines.insert(DAMAGED_LINE - 1, b'{"kind": "call", \x00\x00 garbage')
    log_file.write_bytes(b"\n".join(lines) + b"\n")


def path_sets(tree: Tree) -> dict[str, list]:
    """Each session's paths: the IDs to each of its leaves, with what is trainable."""
    paths = {}
    for session_id, session in tree.sessions.items():
        paths[session_id] = sorted(
            [(node_id_tokens, tree.nodes[leaf].trainable) for leaf in session.leaves
             for node_id_tokens in [tuple(tree.path_token_ids(leaf))]])
    return paths


def reference_tree(scripted, session_of: dict[str, str], kept: list[str]) -> Tree:
    """The tree of the kept calls, built from what the engine was sent and sampled."""
    tree = Tree("reference")
    for call_id in kept:
        sent = scripted.sent[call_id]
        tree.add_call(call_id, session_of[call_id], sent.input_ids, sent.output_ids,
                      sent.logprobs, [7] * len(sent.output_ids))
    return tree


@pytest.mark.parametrize("how", ["truncated", "token changed", "garbage inserted"])
async def test_a_damaged_group_is_set_aside_and_repair_keeps_every_record_that_replays(
        scripted, renderer, tiny_model_dir, tmp_path, how):
    store_dir = tmp_path / "store"
    sessions, call_ids = await write_store(scripted, renderer, tiny_model_dir, store_dir)
    damage(store_dir / "hurt.jsonl", how)

    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:
        assert app[STORE_KEY].damaged["hurt"].line == DAMAGED_LINE
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as page:
            assert 'undertow_store_damaged_groups{group="hurt"} 1' in await page.text()
        async with aiohttp.ClientSession() as http, http.get(
                f"{url}/admin/groups/hurt/tree",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as refused:
            assert refused.status == 503 and "set aside" in await refused.text()
        await chat(sessions["fine"], [{"role": "user", "content": "again"}], f"{url}/v1")
        shown = undertow("trees", "show", str(store_dir), "--group", "fine")
        assert shown.returncode == 0 and "group fine: 1 sessions, 2 calls" in shown.stdout
    finally:
        await runner.cleanup()

    repaired = undertow("trees", "repair", str(store_dir))
    assert repaired.returncode == 0, repaired.stderr
    lost = [] if how == "garbage inserted" else call_ids["b"][1:]
    assert f"kept {3 + TURNS * 3 + 3 - len(lost)} records, moved " in repaired.stdout
    assert f"line {DAMAGED_LINE}: " in repaired.stdout
    assert ("lost: 0 calls (and 1 unreadable" if how == "garbage inserted" else
            "lost: 1 calls (and 1 unreadable" if how == "truncated" else
            "lost: 2 calls,") in repaired.stdout, repaired.stdout
    store = TreeStore(store_dir, create=False)
    list(store.replay(repair=False))
    assert store.damaged == {}
    tree = store.tree("hurt")
    every = [call_ids[name][turn] for turn in range(TURNS) for name in SESSIONS]
    kept = [call_id for call_id in every if call_id not in lost]
    assert [call.call_id for call in tree.calls] == kept
    for call_id in kept:   # each kept call is exactly what the engine was sent and sampled
        sent, got = scripted.sent[call_id], captured(tree, call_id)
        assert (got.prompt_ids, got.completion_ids, got.logprobs) == (
            sent.input_ids, sent.output_ids, sent.logprobs)
    session_of = {call.call_id: call.session_id for call in tree.calls}
    reference = reference_tree(scripted, session_of, kept)
    assert path_sets(tree) == path_sets(reference)
    assert tree.num_unique_tokens == reference.num_unique_tokens
    marked = {sid for sid, paths in tree.sessions.items() if paths.meta.get("infra_failure")}
    assert marked == ({sessions["b"]["session_id"]} if lost else set())   # not trained
    assert all(paths.closed and paths.reward == 1.0 for paths in tree.sessions.values())

    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir)
    try:   # the repaired group serves again
        async with aiohttp.ClientSession() as http:
            opened = await admin(http, "POST", f"{url}/admin/sessions", json={"group": "hurt"})
        await chat(opened, [{"role": "user", "content": "fix the bug " * 10}])
        assert len(app[STORE_KEY].tree("hurt").calls) == len(kept) + 1
    finally:
        await runner.cleanup()
