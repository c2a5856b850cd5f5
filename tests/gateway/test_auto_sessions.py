"""Auto-sessions (`gateway/front/auto_sessions.py`): unknown keys open their own sessions.

A gateway with `auto_sessions` in front of the scripted engine, reached by the real
OpenAI and Anthropic SDKs with keys the gateway never issued. Checked: two clients on
two keys at once make two sessions whose trees hold exactly their own calls, token for
token as the engine sent them; a closed key gets a 401 in the API's own error shape and
no new session; idle sessions expire without a reward, also across a restart.
"""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import openai
import pytest

from tests.gateway.capture import calls_of, captured
from undertow.gateway.front.app import AUTO_SESSIONS_KEY, SESSIONS_KEY
from undertow.gateway.front.config import AutoSessionsConfig
from undertow.gateway.front.trees_cli import show

pytestmark = pytest.mark.asyncio(loop_scope="session")
GROUP = "interactive"


@pytest.fixture
async def auto_gateway(make_gateway, scripted):
    return await make_gateway([scripted.url], auto_sessions=AutoSessionsConfig(GROUP))


def openai_client(gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def anthropic_client(gateway, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway.url, api_key=key, max_retries=0)


async def chat_twice(client: openai.AsyncOpenAI, word: str) -> None:
    """Two turns of one conversation, the second extending the first."""
    messages = [{"role": "user", "content": f"Say {word}."}]
    first = await client.chat.completions.create(model="undertow", messages=messages,
                                                 max_tokens=16)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": f"Again, {word}."}]
    await client.chat.completions.create(model="undertow", messages=messages, max_tokens=16)


async def message_twice(client: anthropic.AsyncAnthropic, word: str) -> None:
    messages = [{"role": "user", "content": f"Say {word}."}]
    first = await client.messages.create(model="undertow", messages=messages, max_tokens=16)
    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": f"Again, {word}."}]
    await client.messages.create(model="undertow", messages=messages, max_tokens=16)


async def metrics_text(gateway) -> str:
    async with gateway.http.get(f"{gateway.url}/metrics") as reply:
        return await reply.text()


async def test_two_keys_at_once_make_two_sessions_that_do_not_mix(auto_gateway, scripted,
                                                                    renderer):
    gateway = auto_gateway
    alpha, bravo = openai_client(gateway, "key-alpha"), anthropic_client(gateway, "key-bravo")
    try:
        await asyncio.gather(chat_twice(alpha, "alpha"), message_twice(bravo, "bravo"),
                             alpha.models.list())
    finally:
        await asyncio.gather(alpha.close(), bravo.close())

    sessions = gateway.app[SESSIONS_KEY].sessions(GROUP)
    assert len(sessions) == 2
    assert all(s.auto and not s.closed and s.meta["opened_by"] == "auto-sessions"
               for s in sessions)
    tree = gateway.tree(GROUP)
    words = {}
    for session in sessions:
        call_ids = calls_of(tree, session.session_id)
        assert len(call_ids) == 2, session.session_id
        first, second = (captured(tree, call_id) for call_id in call_ids)
        for call_id, got in zip(call_ids, (first, second), strict=True):
            sent = scripted.sent[call_id]
            assert got.prompt_ids == sent.input_ids
            assert got.completion_ids == sent.output_ids
            assert got.logprobs == sent.logprobs
        # the second call extends this session's first call, not the other session's
        history = first.prompt_ids + first.completion_ids
        assert second.prompt_ids[:len(history)] == history
        text = renderer.decode(second.prompt_ids)
        words[session.session_id] = {w for w in ("alpha", "bravo") if w in text}
    assert sorted(map(sorted, words.values())) == [["alpha"], ["bravo"]]

    metrics = await metrics_text(gateway)
    assert f'undertow_auto_sessions_enabled{{group="{GROUP}"}} 1' in metrics
    assert "undertow_auto_sessions_opened_total 2" in metrics


async def test_one_new_key_in_many_requests_at_once_is_one_session(make_gateway, scripted):
    # fsync: the open event's write waits for the disk, so the requests overlap there
    gateway = await make_gateway([scripted.url], auto_sessions=AutoSessionsConfig(GROUP),
                                 store_sync="fsync")
    client = openai_client(gateway, "key-burst")
    try:
        await asyncio.gather(*(client.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": f"Hi {i}"}],
            max_tokens=8) for i in range(4)))
    finally:
        await client.close()
    [session] = gateway.app[SESSIONS_KEY].sessions(GROUP)
    assert session.num_calls == 4


async def close_session(gateway, session_id: str, reward: float) -> dict:
    async with gateway.http.post(f"{gateway.url}/admin/sessions/{session_id}/close",
                                 json={"reward": reward}, headers=gateway.admin) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def test_a_closed_key_is_refused_in_each_apis_shape_and_opens_nothing(auto_gateway):
    gateway = auto_gateway
    chat, messages = openai_client(gateway, "key-done"), anthropic_client(gateway, "key-done")
    try:
        await chat.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        [session] = gateway.app[SESSIONS_KEY].sessions(GROUP)
        closed = await close_session(gateway, session.session_id, 1.0)
        assert closed["closed"] and closed["reward"] == 1.0

        with pytest.raises(openai.AuthenticationError) as refused:
            await chat.chat.completions.create(
                model="undertow", messages=[{"role": "user", "content": "More"}], max_tokens=8)
        error = refused.value.body
        assert refused.value.status_code == 401
        assert error["code"] == "invalid_api_key"
        assert session.session_id in error["message"] and "is closed" in error["message"]
        assert "different API key" in error["message"]

        with pytest.raises(anthropic.AuthenticationError) as refused:
            await messages.messages.create(
                model="undertow", messages=[{"role": "user", "content": "More"}], max_tokens=8)
        assert refused.value.status_code == 401
        assert refused.value.body["error"]["type"] == "authentication_error"
        assert "is closed" in refused.value.body["error"]["message"]
    finally:
        await asyncio.gather(chat.close(), messages.close())
    assert [s.session_id for s in gateway.app[SESSIONS_KEY].sessions()] == [session.session_id]
    assert session.num_calls == 1
    assert "undertow_auto_sessions_opened_total 1" in await metrics_text(gateway)


async def test_a_session_path_with_an_unknown_key_opens_nothing(auto_gateway):
    opened = await auto_gateway.open_session(GROUP)
    client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="key-stranger",
                                max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(
                model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    finally:
        await client.close()
    assert len(auto_gateway.app[SESSIONS_KEY]) == 1


async def test_idle_sessions_expire_without_reward_and_stay_closed_after_restart(
        make_gateway, scripted):
    config = AutoSessionsConfig(GROUP, idle_close_s=600, reopen="never")
    gateway = await make_gateway([scripted.url], auto_sessions=config)
    idle, busy = openai_client(gateway, "key-idle"), openai_client(gateway, "key-busy")
    try:
        await idle.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        auto = gateway.app[AUTO_SESSIONS_KEY]
        [idle_session] = gateway.app[SESSIONS_KEY].sessions(GROUP)
        assert await auto.expire_idle(time.monotonic() + 60) == []
        await busy.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        [busy_session] = [s for s in gateway.app[SESSIONS_KEY].sessions(GROUP)
                          if s is not idle_session]
        # the busy session's call came later: halfway between the two calls, plus the idle
        # time, only the idle one is past it (not exactly at its boundary, where the sum
        # `last + idle - last` may round below `idle`)
        assert busy_session.last_used_s > idle_session.last_used_s
        halfway_s = (idle_session.last_used_s + busy_session.last_used_s) / 2
        expired = await auto.expire_idle(halfway_s + config.idle_close_s)
        assert expired == [idle_session.session_id]
        with pytest.raises(openai.AuthenticationError) as refused:
            await idle.chat.completions.create(
                model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        message = refused.value.body["message"]
        assert "idle" in message and "(auto_sessions.reopen: never)" in message
        assert "different API key" in message and "auto_sessions.reopen: expired" in message
    finally:
        await asyncio.gather(idle.close(), busy.close())
    idle_id = idle_session.session_id
    assert idle_session.closed and idle_session.reward is None
    assert not busy_session.closed
    assert "undertow_auto_sessions_expired_total 1" in await metrics_text(gateway)
    events = [json.loads(line) for line in
              (gateway.store_dir / f"{GROUP}.jsonl").read_text().splitlines()]
    assert {"kind": "session_expire", "session_id": idle_id} in [
        {k: v for k, v in event.items() if k != "crc"} for event in events]  # its checksum
    assert not gateway.tree(GROUP).sessions[idle_id].closed  # not trained: no reward
    assert gateway.tree(GROUP).sessions[idle_id].expired
    shown = show(gateway.store_dir, group=GROUP)   # `undertow trees show`, from the store
    assert f"session {idle_id}: expired, no reward" in shown
    assert f"session {busy_session.session_id}: open" in shown

    restarted = await make_gateway([scripted.url], store_dir=gateway.store_dir,
                                   auto_sessions=config)
    client = openai_client(restarted, "key-idle")
    try:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(
                model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    finally:
        await client.close()
    assert len(restarted.app[SESSIONS_KEY]) == 2
    assert restarted.tree(GROUP).sessions[idle_id].expired   # replayed from the store
    closed = await close_session(restarted, idle_id, 0.5)  # a reward set later: trainable
    assert closed["reward"] == 0.5
    assert restarted.tree(GROUP).sessions[idle_id].reward == 0.5


async def test_the_idle_check_runs_by_itself(make_gateway, scripted):
    config = AutoSessionsConfig(GROUP, idle_close_s=0.05, check_interval_s=0.05)
    gateway = await make_gateway([scripted.url], auto_sessions=config)
    client = openai_client(gateway, "key-short")
    try:
        await client.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    finally:
        await client.close()
    [session] = gateway.app[SESSIONS_KEY].sessions(GROUP)
    for _ in range(400):  # a bound on waiting, not a timing check
        if session.closed:
            break
        await asyncio.sleep(0.05)
    assert session.closed and session.reward is None


async def test_without_auto_sessions_unknown_keys_are_refused(gateway):
    client = openai_client(gateway, "key-unknown")
    try:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    finally:
        await client.close()
    assert len(gateway.app[SESSIONS_KEY]) == 0
    assert "undertow_auto_sessions" not in await metrics_text(gateway)


async def test_config_names_a_bad_group_idle_time_or_reopen_policy():
    with pytest.raises(ValueError, match="group"):
        AutoSessionsConfig("bad group!")
    with pytest.raises(ValueError, match="idle_close_s"):
        AutoSessionsConfig("ok", idle_close_s=0)
    with pytest.raises(ValueError, match=r"reopen='sometimes'.*never, expired, closed"):
        AutoSessionsConfig("ok", reopen="sometimes")


async def chat_once(gateway, key: str, content: str = "Hi") -> None:
    client = openai_client(gateway, key)
    try:
        await client.chat.completions.create(
            model="undertow", messages=[{"role": "user", "content": content}], max_tokens=8)
    finally:
        await client.close()


async def test_an_expired_key_reopens_as_a_new_session_of_its_group(make_gateway, scripted):
    """The default (`reopen: expired`): an agent that kept its key in a config file comes
    back after its session expired and gets a new session under that key; the expired
    one stays as it was, also across a restart; a close with a reward is not reopened."""
    config = AutoSessionsConfig(GROUP, idle_close_s=600)
    gateway = await make_gateway([scripted.url], auto_sessions=config)
    await chat_once(gateway, "key-config-file", "First run")
    [expired] = gateway.app[SESSIONS_KEY].sessions(GROUP)
    assert await gateway.app[AUTO_SESSIONS_KEY].expire_idle(
        expired.last_used_s + config.idle_close_s) == [expired.session_id]
    await chat_once(gateway, "key-config-file", "Second run")  # the re-run, same key

    sessions = gateway.app[SESSIONS_KEY]
    reopened = sessions.of_key("key-config-file")
    assert reopened is not expired and not reopened.closed and reopened.auto
    assert reopened.group == GROUP and reopened.meta["reopens"] == expired.session_id
    assert expired.closed and expired.expired and expired.reward is None
    tree = gateway.tree(GROUP)
    assert len(calls_of(tree, expired.session_id)) == len(calls_of(tree, reopened.session_id)) == 1
    assert tree.sessions[expired.session_id].expired
    assert "undertow_auto_sessions_reopened_total 1" in await metrics_text(gateway)

    restarted = await make_gateway([scripted.url], store_dir=gateway.store_dir,
                                   auto_sessions=config)
    await chat_once(restarted, "key-config-file", "Second run, more")
    sessions = restarted.app[SESSIONS_KEY]
    assert sessions.of_key("key-config-file").session_id == reopened.session_id
    assert sessions.find(expired.session_id).expired
    assert len(sessions.sessions(GROUP)) == 2
    assert sessions.find(reopened.session_id).num_calls == 2

    await close_session(restarted, reopened.session_id, 1.0)  # scored: not reopened
    with pytest.raises(openai.AuthenticationError) as refused:
        await chat_once(restarted, "key-config-file", "Third run")
    message = refused.value.body["message"]
    assert reopened.session_id in message and "closed with reward 1" in message
    assert "auto_sessions.reopen: closed" in message and "different API key" in message
    assert len(sessions.sessions(GROUP)) == 2


async def test_reopen_closed_reopens_a_scored_key_too(make_gateway, scripted):
    gateway = await make_gateway([scripted.url],
                                 auto_sessions=AutoSessionsConfig(GROUP, reopen="closed"))
    await chat_once(gateway, "key-scored")
    [scored] = gateway.app[SESSIONS_KEY].sessions(GROUP)
    await close_session(gateway, scored.session_id, 0.0)
    await chat_once(gateway, "key-scored", "Again")
    reopened = gateway.app[SESSIONS_KEY].of_key("key-scored")
    assert reopened.meta["reopens"] == scored.session_id and not reopened.closed
    assert scored.reward == 0.0 and len(calls_of(gateway.tree(GROUP), scored.session_id)) == 1
