"""The write-ahead tree store: a gateway killed with SIGKILL and restarted on the same
store still has every call whose reply was delivered, and its sessions' keys; the
trees CLI reads the store back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import openai
import pytest

from tests.gateway.conftest import ADMIN_TOKEN
from undertow.gateway.store import TreeStore
from undertow.gateway.trees_cli import show, stats

pytestmark = pytest.mark.asyncio(loop_scope="session")
LISTENING = "undertow gateway listening on "


async def start_gateway_process(engine_url: str, model_dir, store_dir, store_sync="flush"):
    env = dict(os.environ, UNDERTOW_ADMIN_TOKEN=ADMIN_TOKEN)
    process = subprocess.Popen(
        [sys.executable, "-m", "undertow.cli", "gateway", "serve", "--engine", engine_url,
         "--model", str(model_dir), "--store", str(store_dir), "--port", "0",
         "--store-sync", store_sync],
        stdout=subprocess.PIPE, text=True, env=env)
    line = await asyncio.to_thread(process.stdout.readline)
    if not line.startswith(LISTENING):
        process.kill()
        process.wait()
        raise RuntimeError(f"the gateway did not start: {line!r}")
    return process, line[len(LISTENING):].strip()


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    process.stdout.close()


async def admin(http, method: str, url: str, **kwargs):
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with http.request(method, url, headers=headers, **kwargs) as reply:
        assert reply.status in (200, 201), await reply.text()
        return await reply.json()


@pytest.mark.parametrize("store_sync", ["flush", "fsync"])
async def test_sigkill_and_restart_keeps_every_delivered_call(scripted, tiny_model_dir,
                                                              tmp_path, store_sync):
    import aiohttp

    store = tmp_path / "store"
    process, url = await start_gateway_process(scripted.url, tiny_model_dir, store, store_sync)
    async with aiohttp.ClientSession() as http:
        try:
            session = await admin(http, "POST", f"{url}/admin/sessions", json={"group": "task1"})
            client = openai.AsyncOpenAI(base_url=session["base_url"],
                                        api_key=session["api_key"])
            messages = [{"role": "user", "content": "start"}]
            call_ids = []
            for turn in range(5):
                reply = await client.chat.completions.create(model="m", messages=messages)
                call_ids.append(reply.id.removeprefix("chatcmpl-"))
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": f"turn {turn}"}]
            await client.close()
        finally:
            kill(process)
        before = show(store, group="task1")
        process, url = await start_gateway_process(scripted.url, tiny_model_dir, store)
        try:
            tree = await admin(http, "GET", f"{url}/admin/sessions/{session['session_id']}/tree")
            assert [call["call_id"] for call in tree["calls"]] == call_ids
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=session["api_key"])
            await client.chat.completions.create(model="m", messages=messages)
            await client.close()
            tree = await admin(http, "GET", f"{url}/admin/groups/task1/tree")
            assert len(tree["calls"]) == 6
        finally:
            kill(process)
    assert "branch point" not in before and "* sampled by" in before
    table = stats(store)
    assert "| task1 | 1 | 6 |" in table


async def test_store_grows_with_unique_tokens(gateway, scripted):
    session = await gateway.open_session(group="grow")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages = [{"role": "user", "content": "start " * 50}]
    for turn in range(8):
        reply = await client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"turn {turn}"}]
    await client.close()
    tree = gateway.tree("grow")
    lines = [json.loads(line) for line in (gateway.store_dir / "grow.jsonl").read_text()
             .splitlines()]
    stored = [len(line["token_ids"]) for line in lines if line["kind"] == "call"]
    contexts = [len(tree.path_token_ids(call.leaf)) for call in tree.calls]
    assert sum(stored) == tree.num_unique_tokens
    assert stored[-1] * 4 < contexts[-1]  # a late call stores only its new tokens


async def test_flush_mode_hands_the_line_to_the_os_before_submit_returns(tmp_path):
    store = TreeStore(tmp_path, sync="flush", fsync_interval_s=60.0)
    await store.start()
    try:
        done = store.submit("g1", {"kind": "session_close", "session_id": "s", "reward": 1.0})
        # no await in between: another process reading the file sees the line already
        assert done.done()
        assert json.loads((tmp_path / "g1.jsonl").read_bytes())["reward"] == 1.0
    finally:
        await store.close()
    assert json.loads((tmp_path / "g1.jsonl").read_bytes())["session_id"] == "s"


async def test_fsync_mode_resolves_once_the_line_is_written(tmp_path):
    store = TreeStore(tmp_path, sync="fsync")
    await store.start()
    try:
        done = store.submit("g1", {"kind": "session_close", "session_id": "s", "reward": 0.5})
        await done
        assert json.loads((tmp_path / "g1.jsonl").read_bytes())["reward"] == 0.5
    finally:
        await store.close()
