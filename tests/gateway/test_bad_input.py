"""Bad input gets the status and error body each SDK parses, and does not disturb
a call in flight; the admin API guards sessions and trees."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from tests.gateway.capture import calls_of
from undertow.gateway.engine_pool.router import RouterConfig
from undertow.gateway.errors import BadRequest
from undertow.gateway.front.api.openai_chat import KnownMessages, parse_messages
from undertow.gateway.front.app import POOL_KEY, SESSIONS_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def post(gateway, path: str, session: dict, data, **headers):
    headers = {"Authorization": f"Bearer {session['api_key']}", **headers}
    kwargs = {"data": data} if isinstance(data, bytes | str) else {"json": data}
    async with gateway.http.post(f"{gateway.url}{path}", headers=headers, **kwargs) as reply:
        return reply.status, await reply.json(), reply.headers


async def test_openai_shaped_errors(make_gateway, scripted):
    gateway = await make_gateway([scripted.url], max_body_bytes=50_000, context_length=300)
    session = await gateway.open_session()
    chat = "/v1/chat/completions"
    status, body, _ = await post(gateway, chat, session, b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = await post(gateway, chat, session, {"model": "m", "messages": [
        {"role": "user", "content": "x" * 60_000}]})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body, _ = await post(gateway, chat, session, {"model": "m", "messages": [
        {"role": "user", "content": "word " * 400}]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body, _ = await post(gateway, chat, session, {"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "frobnicate": 1})
    assert status == 400 and body["error"]["param"] == "frobnicate"
    status, body, _ = await post(gateway, chat, {"api_key": "sk-wrong"}, {"model": "m"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"

    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "word " * 400}])
        assert caught.value.code == "context_length_exceeded"
    finally:
        await client.close()
    assert calls_of(gateway.tree(), session["session_id"]) == []


async def until_in_flight(pool, num: int) -> None:
    while pool.describe()[0]["num_in_flight"] != num:
        await asyncio.sleep(0.01)


async def test_a_full_pool_answers_429_with_retry_after_and_no_engine_503(make_gateway,
                                                                          scripted):
    router = RouterConfig(max_in_flight_per_engine=1, retry_after_s=2.5, admission_wait_s=0)
    gateway = await make_gateway([scripted.url], router=router)
    pool = gateway.app[POOL_KEY]
    session = await gateway.open_session()
    hello = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    # n = 2 against a limit of 1: the second choice is refused, and so is the call.
    status, body, headers = await post(gateway, "/v1/chat/completions", session,
                                       {**hello, "n": 2})
    assert (status, headers["Retry-After"]) == (429, "3")
    assert body["error"]["code"] == "rate_limit_exceeded"
    await until_in_flight(pool, 0)  # the admitted first choice, cancelled
    scripted.delay_s = 0.02
    slow = asyncio.create_task(post(gateway, "/v1/chat/completions", session, hello))
    await until_in_flight(pool, 1)
    other = await gateway.open_session()
    status, body, headers = await post(gateway, "/v1/messages", other,
                                       {**hello, "max_tokens": 4})
    assert (status, headers["Retry-After"]) == (429, "3")
    assert body["error"]["type"] == "rate_limit_error"
    assert (await slow)[0] == 200
    assert len(calls_of(gateway.tree(), session["session_id"])) == 1
    assert calls_of(gateway.tree(), other["session_id"]) == []

    empty = await make_gateway([])
    session = await empty.open_session()
    status, body, _ = await post(empty, "/v1/chat/completions", session, hello)
    assert status == 503 and body["error"]["code"] == "service_unavailable"
    status, body, _ = await post(empty, "/v1/messages", session, {**hello, "max_tokens": 4})
    assert status == 529 and body["error"]["type"] == "overloaded_error"


async def test_a_key_reaches_only_its_own_session(gateway):
    mine, other = await gateway.open_session(), await gateway.open_session()
    path = f"/s/{other['session_id']}/v1/chat/completions"
    status, body, _ = await post(gateway, path, mine, {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 401 and "invalid API key" in body["error"]["message"]


async def test_anthropic_shaped_errors(gateway):
    session = await gateway.open_session()
    client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key="sk-wrong", max_retries=0)
    try:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="c", max_tokens=5,
                                         messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()
    status, body, _ = await post(gateway, "/v1/messages", session, {"model": "c", "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 400 and body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}


async def test_bad_requests_do_not_disturb_a_call_in_flight(gateway, scripted, renderer):
    scripted.delay_s = 0.02
    session = await gateway.open_session()
    good = asyncio.create_task(post(gateway, "/v1/chat/completions", session, {
        "model": "m", "messages": [{"role": "user", "content": "slow one"}]}))
    await asyncio.sleep(0.05)
    for bad in (b"\xff\xfe", b"[]", b'{"model": 5}'):
        status, _, _ = await post(gateway, "/v1/chat/completions", session, bad)
        assert status == 400
    status, body, _ = await good
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello from the script."
    assert len(calls_of(gateway.tree(), session["session_id"])) == 1


async def test_admin_sessions_close_and_trees(gateway):
    async with gateway.http.post(f"{gateway.url}/admin/sessions", json={"group": "g"}) as reply:
        assert reply.status == 401
    session = await gateway.open_session(group="g", meta={"task": "t1"})
    status, _, _ = await post(gateway, "/v1/chat/completions", session, {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    url = f"{gateway.url}/admin/sessions/{session['session_id']}/close"
    async with gateway.http.post(url, json={"reward": 0.5, "meta": {"passed": 1}},
                                 headers=gateway.admin) as reply:
        assert reply.status == 200 and (await reply.json())["reward"] == 0.5
    tree = await gateway.session_tree(session["session_id"])
    assert tree["sessions"][session["session_id"]]["reward"] == 0.5
    assert len(tree["calls"]) == 1 and any(node["trainable"] for node in tree["nodes"])
    async with gateway.http.get(f"{gateway.url}/admin/sessions?group=g",
                                headers=gateway.admin) as reply:
        listed = (await reply.json())["sessions"]
    assert [s["session_id"] for s in listed] == [session["session_id"]]
    status, _, _ = await post(gateway, "/v1/chat/completions", session, {
        "model": "m", "messages": [{"role": "user", "content": "after close"}]})
    assert status == 401


async def test_known_history_is_reused_and_new_messages_are_still_validated():
    history = [{"role": "developer", "content": "be brief"},
               {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    parsed = parse_messages(history)
    known = KnownMessages(history, parsed)
    longer = parse_messages([*history, {"role": "assistant", "content": "ok"},
                             {"role": "user", "content": "more"}], known)
    assert longer[:2] == parsed and longer[0] is parsed[0]  # reused, not parsed again
    assert longer[0] == {"role": "system", "content": "be brief"}
    with pytest.raises(BadRequest):
        parse_messages([*history, {"role": "robot", "content": "x"}], known)
    edited = [{"role": "developer", "content": "be verbose"}, history[1]]
    assert parse_messages(edited, known)[0] == {"role": "system", "content": "be verbose"}


async def test_a_closed_session_lets_go_of_its_history(make_gateway, scripted, tmp_path):
    """Closing a session frees what only its next call would use (its heads hold the
    history's IDs), and the open-session gauge counts as sessions open and close, also
    after a restart."""
    gateway = await make_gateway([scripted.url], store_dir=tmp_path / "store")
    sessions = [await gateway.open_session() for _ in range(3)]
    client = openai.AsyncOpenAI(base_url=sessions[0]["base_url"],
                                api_key=sessions[0]["api_key"], max_retries=0)
    try:
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "more"}]
    finally:
        await client.close()
    registry = gateway.app[SESSIONS_KEY]
    held = registry.get(sessions[0]["session_id"])
    assert held.heads and held.heads[-1].token_ids and held.known_messages

    async def open_gauge(gateway) -> float:
        async with gateway.http.get(f"{gateway.url}/metrics") as reply:
            text = await reply.text()
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("undertow_open_sessions ")))

    assert await open_gauge(gateway) == 3
    for session in sessions[:2]:
        url = f"{gateway.url}/admin/sessions/{session['session_id']}/close"
        async with gateway.http.post(url, json={"reward": 1.0}, headers=gateway.admin) as reply:
            assert reply.status == 200
    assert (held.heads, held.replies, held.known_messages) == ([], {}, {})
    assert held.closed and held.reward == 1.0 and held.num_calls == 2
    assert await open_gauge(gateway) == 1
    restarted = await make_gateway([scripted.url], store_dir=tmp_path / "store")
    assert await open_gauge(restarted) == 1
    assert restarted.app[SESSIONS_KEY].get(sessions[0]["session_id"]).heads == []
    assert restarted.app[SESSIONS_KEY].get(sessions[2]["session_id"]).closed is False
