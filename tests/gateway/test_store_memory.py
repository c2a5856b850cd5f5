"""The tree store's memory is bounded: idle groups (no open session) past
`store_max_idle_trees` are let go (tree and file descriptor) and loaded back from their
file when used, with the same answers from the admin API, also after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from undertow.gateway.front.app import METRICS_KEY, STORE_KEY
from undertow.gateway.front.store import TreeStore

pytestmark = pytest.mark.asyncio(loop_scope="session")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def open_store_files(store_dir: Path) -> set[str]:
    """The names of the files under `store_dir` this process holds open."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{store_dir}/"):
                names.add(Path(target).name)
    return names


async def admin(url: str, method: str, path: str, body: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as http, http.request(
            method, f"{url}{path}", json=body, headers=ADMIN) as reply:
        assert reply.status in (200, 201), await reply.text()
        return await reply.json()


async def chat(session: dict, turns: list[str]) -> None:
    """One call per turn, each continuing the conversation so far."""
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages: list[dict] = []
    try:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    finally:
        await client.close()


async def open_session(url: str, group: str) -> dict:
    return await admin(url, "POST", "/admin/sessions", {"group": group})


async def close_session(url: str, session: dict, reward: float = 1.0) -> None:
    await admin(url, "POST", f"/admin/sessions/{session['session_id']}/close",
                {"reward": reward})


async def groups_listed(url: str) -> dict[str, dict]:
    return {entry["group"]: entry for entry in (await admin(url, "GET", "/admin/groups"))["groups"]}


def loads(app) -> float:
    return app[METRICS_KEY].store_tree_loads.value()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
async def test_idle_trees_past_the_bound_are_let_go_and_answer_the_same(
        scripted, tiny_model_dir, tmp_path):
    store_dir, groups = tmp_path / "store", ["g0", "g1", "g2", "g3"]
    # fsync: a group's lines are fsync'ed before its close returns, so its file closes at once
    config = {"store_max_idle_trees": 2, "store_sync": "fsync"}
    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir, **config)
    trees, session_trees, listed, sessions = {}, {}, {}, {}
    try:
        store = app[STORE_KEY]
        for group in groups:
            sessions[group] = session = await open_session(url, group)
            await chat(session, ["Hi.", "Go on."])
            await close_session(url, session)
            assert group in store.trees  # the most recently used idle tree stays
            # taken while in memory: the references the reloaded trees must equal
            trees[group] = await admin(url, "GET", f"/admin/groups/{group}/tree")
            session_trees[group] = await admin(
                url, "GET", f"/admin/sessions/{session['session_id']}/tree")
            listed[group] = (await groups_listed(url))[group]
        assert list(store.trees) == ["g2", "g3"]
        assert open_store_files(store_dir) == {"g2.jsonl", "g3.jsonl"}
        assert app[METRICS_KEY].store_trees_in_memory.value() == 2
        assert await groups_listed(url) == listed  # all four, let go or not
        for group in ["g0", "g1"]:
            assert await admin(url, "GET", f"/admin/groups/{group}/tree") == trees[group]
            session_id = sessions[group]["session_id"]
            assert await admin(url, "GET", f"/admin/sessions/{session_id}/tree") == (
                session_trees[group])
            assert len(store.trees) == 2
        assert loads(app) == 2
        assert list(store.trees) == ["g0", "g1"]
        assert open_store_files(store_dir) == set()  # reloaded for reading: no file opened

        again = await open_session(url, "g2")  # g2 was let go: it is active again
        await chat(again, ["Once more."])
        tree = await admin(url, "GET", "/admin/groups/g2/tree")
        assert [call["call_id"] for call in tree["calls"]][:2] == [
            call["call_id"] for call in trees["g2"]["calls"]]
        assert [call["session_id"] for call in tree["calls"]] == (
            [sessions["g2"]["session_id"]] * 2 + [again["session_id"]])
        assert "g2.jsonl" in open_store_files(store_dir)
        await close_session(url, again, reward=0.5)
        trees["g2"] = await admin(url, "GET", "/admin/groups/g2/tree")
        listed = await groups_listed(url)
    finally:
        await runner.cleanup()

    app, runner, url = await start_gateway([scripted.url], tiny_model_dir, store_dir, **config)
    try:
        assert len(app[STORE_KEY].trees) <= 2
        assert await groups_listed(url) == listed
        for group in groups:
            assert await admin(url, "GET", f"/admin/groups/{group}/tree") == trees[group]
            assert len(app[STORE_KEY].trees) <= 2
    finally:
        await runner.cleanup()


async def test_bound_0_lets_every_idle_tree_go_and_never_an_open_sessions(
        make_gateway, scripted):
    gateway = await make_gateway([scripted.url], store_max_idle_trees=0)
    store = gateway.app[STORE_KEY]
    keeper = await open_session(gateway.url, "keep")
    await chat(keeper, ["Hi."])
    for index in range(3):
        session = await open_session(gateway.url, f"idle{index}")
        await chat(session, ["Hi.", "Go on."])
        await close_session(gateway.url, session)
        assert list(store.trees) == ["keep"]
    await chat(keeper, ["Hi.", "And then?"])
    assert len(store.tree("keep").calls) == 3
    assert loads(gateway.app) == 0
    await close_session(gateway.url, keeper)
    assert list(store.trees) == []
    listed = await groups_listed(gateway.url)
    assert {group: entry["num_calls"] for group, entry in listed.items()} == {
        "idle0": 2, "idle1": 2, "idle2": 2, "keep": 3}


async def test_a_call_in_flight_when_its_session_closes_is_recorded(make_gateway, scripted):
    gateway = await make_gateway([scripted.url], store_max_idle_trees=0)
    store = gateway.app[STORE_KEY]
    session = await open_session(gateway.url, "late")
    scripted.delay_s = 0.05  # per token: the call runs for about half a second
    call = asyncio.create_task(chat(session, ["Hi."]))
    while not scripted.num_requests:
        await asyncio.sleep(0.01)
    await close_session(gateway.url, session)
    assert "late" not in store.trees  # let go while its call runs
    assert not call.done()
    await call
    assert "late" in store.trees  # loaded back to record the call
    assert loads(gateway.app) == 1
    assert [c["session_id"] for c in (await admin(gateway.url, "GET",
                                                  "/admin/groups/late/tree"))["calls"]] == [
        session["session_id"]]


async def test_a_group_let_go_closes_its_file_after_its_fsync(tmp_path):
    store = TreeStore(tmp_path, fsync_interval_s=0.0, max_idle_trees=0)
    await store.start()
    try:
        store.tree("a").close_session("s", 1.0)
        await store.submit("a", {"kind": "session_close", "session_id": "s", "reward": 1.0})
        store.group_idle("a")
        assert "a" not in store.trees
        assert "a.jsonl" in open_store_files(tmp_path)  # its line awaits the background fsync
        for _ in range(500):
            if not open_store_files(tmp_path):
                break
            await asyncio.sleep(0.01)
        assert open_store_files(tmp_path) == set()
        assert store.tree("a").sessions["s"].reward == 1.0
        assert store.metrics.store_tree_loads.value() == 1
    finally:
        await store.close()
