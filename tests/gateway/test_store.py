"""The write-ahead tree store: a gateway killed with SIGKILL and restarted on the same
store still has every call whose reply was delivered, and its sessions' keys; a write
that fails for real (a full tmpfs) is a retryable 503 that changes nothing, unless the
call was streamed (its client has the text): then it is held and written, in order, when
the disk has room, or, past the hold's bounds, dropped and its session an infra failure;
the trees CLI reads the store back. Damaged logs: `test_store_repair.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys

import aiohttp
import anthropic
import openai
import pytest

from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN
from tests.gateway.test_api_scripted import script
from undertow.gateway.front.app import SESSIONS_KEY
from undertow.gateway.front.store import TreeStore
from undertow.gateway.front.trees_cli import show, stats
from undertow.gateway.trees.tree import tree_to_json

pytestmark = pytest.mark.asyncio(loop_scope="session")
LISTENING = "undertow gateway listening on "


async def start_gateway_process(engine_url: str, model_dir, store_dir, store_sync="flush"):
    env = dict(os.environ, UNDERTOW_ADMIN_TOKEN=ADMIN_TOKEN)
    process = subprocess.Popen(
        [sys.executable, "-m", "undertow.cli", "gateway", "serve", "--engine", engine_url,
         "--model", str(model_dir), "--store", str(store_dir), "--port", "0",
         f"store_sync={store_sync}"],
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


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (we run as root in CI), so that writes fail for real when it is full;
    skipped only where no tmpfs can be mounted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def fill(disk) -> object:
    """Writes a file until the disk refuses another byte; returns its path."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * size)
    return filler


def page_slack(path) -> int:
    """Bytes a file can still grow without a new page: a write that needs more than this
    on a full tmpfs is written in part, then refused."""
    stat = os.stat(path)
    return stat.st_blocks * 512 - stat.st_size


def snapshot(gateway, session_id: str, group: str) -> tuple:
    session = gateway.app[SESSIONS_KEY].get(session_id)
    heads = [(h.call_id, h.message_keys, h.leaf, h.num_prompt_tokens, h.closing_text,
              h.assistant) for h in session.heads]
    tree = json.dumps(tree_to_json(gateway.tree(group)), sort_keys=True)
    return ((gateway.store_dir / f"{group}.jsonl").read_bytes(), tree, heads,
            session.num_calls, session.closed)


@pytest.mark.parametrize("store_sync", ["flush", "fsync"])
async def test_a_full_disk_answers_503_and_leaves_tree_log_and_heads_as_they_were(
        make_gateway, scripted, renderer, small_disk, store_sync):
    gateway = await make_gateway([scripted.url], store_dir=small_disk / "store",
                                 store_sync=store_sync)
    session = await gateway.open_session(group="full")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    messages = [{"role": "user", "content": "start"}]
    for turn in range(2):
        script(scripted, renderer, f"step {turn}")
        reply = await client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"observation {turn} " * 200}]
    filler = fill(small_disk)
    before = snapshot(gateway, session["session_id"], "full")
    assert 0 < page_slack(gateway.store_dir / "full.jsonl") < 4096  # a line is written in part
    script(scripted, renderer, "a long reply " * 200)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(model="m", messages=messages)
    assert refused.value.status_code == 503
    assert "could not write" in refused.value.message
    assert snapshot(gateway, session["session_id"], "full") == before

    async with gateway.http.post(f"{gateway.url}/admin/sessions", json={"group": "other"},
                                 headers=gateway.admin) as opening:
        assert opening.status == 503  # a new group's file gets no page
    async with gateway.http.get(f"{gateway.url}/admin/sessions", headers=gateway.admin) as listed:
        assert [s["session_id"] for s in (await listed.json())["sessions"]] == [
            session["session_id"]]
    async with gateway.http.post(  # its line is longer than the file's page slack
            f"{gateway.url}/admin/sessions/{session['session_id']}/close",
            json={"reward": 1.0, "meta": {"log": "x" * 5000}}, headers=gateway.admin) as closing:
        assert closing.status == 503
    assert snapshot(gateway, session["session_id"], "full") == before

    filler.unlink()  # the scaffold's retry, once the disk has room again
    script(scripted, renderer, "a long reply " * 200)
    await client.chat.completions.create(model="m", messages=messages)
    await client.close()
    tree = gateway.tree("full")
    _, second, third = (captured(tree, c) for c in calls_of(tree, session["session_id"]))
    assert third.branch is None and third.meta["extends"] == tree.calls[1].call_id
    assert third.prompt_ids[:len(second.prompt_ids) + len(second.completion_ids)] == (
        second.prompt_ids + second.completion_ids)
    replayed = TreeStore(gateway.store_dir, create=False)
    assert len([e for e in replayed.replay(repair=False) if e["kind"] == "call"]) == 3


async def test_a_full_disk_fails_a_streamed_anthropic_call_retryably_when_none_is_held(
        make_gateway, scripted, renderer, small_disk):
    gateway = await make_gateway([scripted.url], store_dir=small_disk / "store",
                                 store_hold_max_bytes=0)
    session = await gateway.open_session(group="full")
    client = anthropic.AsyncAnthropic(base_url=f"{gateway.url}/s/{session['session_id']}",
                                      api_key=session["api_key"], max_retries=0)
    filler = fill(small_disk)
    before = snapshot(gateway, session["session_id"], "full")
    script(scripted, renderer, "streamed " * 400)
    with pytest.raises(anthropic.APIError) as refused:
        async with client.messages.stream(model="m", max_tokens=1000, messages=[
                {"role": "user", "content": "go"}]) as stream:
            async for _ in stream:
                pass
    assert "could not write" in str(refused.value)
    script(scripted, renderer, "streamed " * 400)
    with pytest.raises(anthropic.APIStatusError) as overloaded:  # not streamed: the status
        await client.messages.create(model="m", max_tokens=1000,
                                     messages=[{"role": "user", "content": "go"}])
    assert overloaded.value.status_code == 529  # Anthropic's retryable "overloaded"
    assert overloaded.value.body["error"]["type"] == "overloaded_error"
    assert snapshot(gateway, session["session_id"], "full") == before
    filler.unlink()
    script(scripted, renderer, "streamed " * 400)
    reply = await client.messages.create(model="m", max_tokens=1000,
                                         messages=[{"role": "user", "content": "go"}])
    await client.close()
    assert reply.content[0].text.startswith("streamed")
    assert len(gateway.tree("full").calls) == 1


async def stream_chat(client, messages) -> tuple[str, str]:
    """A streamed chat call: (call ID, the text the client received)."""
    stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
    call_id, text = "", ""
    async for chunk in stream:
        call_id = chunk.id.removeprefix("chatcmpl-")
        text += "".join(choice.delta.content or "" for choice in chunk.choices)
    return call_id, text


async def eventually(check, what: str) -> None:
    """Waits (polling, up to a minute) until `check()` holds."""
    for _ in range(600):
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def logged_call_ids(gateway, group: str) -> list[str]:
    lines = (gateway.store_dir / f"{group}.jsonl").read_bytes().split(b"\n")[:-1]
    return [event["call_id"] for event in map(json.loads, lines) if event["kind"] == "call"]


def replayed_tree(store_dir, group: str) -> str:
    replayed = TreeStore(store_dir, create=False)
    list(replayed.replay(repair=False))
    return json.dumps(tree_to_json(replayed.tree(group)), sort_keys=True)


async def test_streamed_calls_on_a_full_disk_are_held_and_written_in_order_when_it_has_room(
        make_gateway, scripted, renderer, small_disk):
    gateway = await make_gateway([scripted.url], store_dir=small_disk / "store")
    session = await gateway.open_session(group="held")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    messages = [{"role": "user", "content": "start"}]
    script(scripted, renderer, "step 0")
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    filler = fill(small_disk)
    before = (gateway.store_dir / "held.jsonl").read_bytes()
    received = []
    for turn in range(2):   # each one's lines are refused, the text already sent
        messages.append({"role": "user", "content": f"observation {turn} " * 200})
        script(scripted, renderer, f"streamed {turn} " * 200)
        call_id, text = await stream_chat(client, messages)
        assert text.startswith(f"streamed {turn}")          # the stream ended normally
        received.append(call_id)
        messages.append({"role": "assistant", "content": text})
    assert (gateway.store_dir / "held.jsonl").read_bytes() == before
    assert [call.call_id for call in gateway.tree("held").calls][1:] == received
    with pytest.raises(openai.APIStatusError) as refused:   # may not land before them
        await client.chat.completions.create(model="m", messages=messages)
    assert refused.value.status_code == 503
    async with gateway.http.get(f"{gateway.url}/metrics") as page:
        assert "undertow_store_held_bytes 0" not in await page.text()

    filler.unlink()
    await eventually(lambda: len(logged_call_ids(gateway, "held")) == 3, "held lines written")
    assert logged_call_ids(gateway, "held") == [first.id.removeprefix("chatcmpl-"), *received]
    live = json.dumps(tree_to_json(gateway.tree("held")), sort_keys=True)
    assert replayed_tree(gateway.store_dir, "held") == live
    for call_id in received:   # what the client received is what the tree records
        assert captured(gateway.tree("held"), call_id).completion_ids == (
            scripted.sent[call_id].output_ids)
    state = gateway.app[SESSIONS_KEY].get(session["session_id"])
    assert not [reason for reason in state.infra_errors if "dropped" in reason]  # none lost
    await client.close()


async def test_held_lines_past_the_time_bound_are_dropped_and_the_session_is_an_infra_failure(
        make_gateway, scripted, renderer, small_disk):
    gateway = await make_gateway([scripted.url], store_dir=small_disk / "store",
                                 store_hold_max_s=0.2)
    session = await gateway.open_session(group="lost")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    messages = [{"role": "user", "content": "start"}]
    script(scripted, renderer, "step 0")
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "observation " * 200}]
    filler = fill(small_disk)
    before = snapshot(gateway, session["session_id"], "lost")
    script(scripted, renderer, "streamed " * 200)
    _, text = await stream_chat(client, messages)
    assert text.startswith("streamed") and len(gateway.tree("lost").calls) == 2
    state = gateway.app[SESSIONS_KEY].get(session["session_id"])
    await eventually(lambda: state.infra_errors, "the held call dropped")
    assert [reason for reason in state.infra_errors if "dropped" in reason]
    log_bytes, tree, heads, _, _ = snapshot(gateway, session["session_id"], "lost")
    assert (log_bytes, tree, heads) == (before[0], before[1], [])   # the file's tree
    filler.unlink()
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    script(scripted, renderer, "after")
    later, _ = await stream_chat(client, messages)   # recorded on the tree as the file has it
    assert captured(gateway.tree("lost"), later).prompt_ids == scripted.sent[later].input_ids
    closed = await admin(gateway.http, "POST", f"{gateway.url}/admin/sessions/"
                         f"{session['session_id']}/close", json={"reward": 1.0})
    assert closed["closed"]
    close_line = json.loads((gateway.store_dir / "lost.jsonl").read_bytes().split(b"\n")[-2])
    assert close_line["kind"] == "session_close" and close_line["meta"]["infra_failure"]
    assert logged_call_ids(gateway, "lost") == [first.id.removeprefix("chatcmpl-"), later]
    assert replayed_tree(gateway.store_dir, "lost") == json.dumps(
        tree_to_json(gateway.tree("lost")), sort_keys=True)
    async with gateway.http.get(f"{gateway.url}/metrics") as page:
        assert "undertow_store_dropped_lines_total 1" in await page.text()
    await client.close()
