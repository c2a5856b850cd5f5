"""Failures of Undertow's own, as a session meets them (`api/errors.py`, `sessions.py`):
every error reply the gateway gives a session (a 5xx, a 429, Anthropic's 529, an error
event that ends a stream) is noted on it with its reason, and its close makes it an infra
failure whatever the closer said: the tree's session meta (what the learner reads) says
`infra_failure: true`, cause `error:gateway`, the reasons, and the closer's cause as
`scaffold_cause`; the learner finds no valid session in it. A refusal of the request
itself (a 400) is the policy's, not noted. Each call counts in `undertow_calls_total` by
the status its client effectively got: a stream ended by an error event counts with the
error's status, not with its head's 200.

Real parts: the gateway, the scripted engine (a real SGLang-protocol server, stopped
mid-stream for an engine lost), the openai and anthropic SDKs."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import ADMIN_TOKEN, Gateway
from tests.gateway.test_api_scripted import script
from undertow.gateway.engine_pool.pool import EnginePool, PoolConfig
from undertow.gateway.engine_pool.router import RouterConfig
from undertow.gateway.front.app import create_app
from undertow.gateway.front.config import GatewayConfig
from undertow.learner.advantages import infra_failures, valid_sessions

pytestmark = pytest.mark.asyncio(loop_scope="session")
DEAD_ENGINE_URL = "http://127.0.0.1:9"  # the discard port: nothing answers there
RESUME_TIMEOUT_S = 0.5


@contextlib.asynccontextmanager
async def gateway_losing_its_engine(model_dir, store_dir, scripted):
    """A gateway whose one engine, the scripted one, can be stopped mid-stream
    (`stop_engine()`), and whose generations wait `RESUME_TIMEOUT_S` for another."""
    engine = web.AppRunner(scripted.app(), access_log=None)
    await engine.setup()
    await web.TCPSite(engine, "127.0.0.1", 0).start()
    pool = EnginePool([f"http://127.0.0.1:{engine.addresses[0][1]}"],
                      PoolConfig(resume_timeout_s=RESUME_TIMEOUT_S, health_interval_s=0.1))
    await pool.start()
    app = create_app(GatewayConfig(model_dir=model_dir, store_dir=store_dir,
                                   admin_token=ADMIN_TOKEN), pool=pool)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    http = aiohttp.ClientSession()

    async def stop_engine() -> None:
        assert engine.server is not None
        for connection in engine.server.connections:   # cut its streams, as a kill does
            if connection.transport is not None:
                connection.transport.abort()
        await engine.cleanup()

    try:
        yield Gateway(f"http://127.0.0.1:{runner.addresses[0][1]}", app, store_dir, http), \
            stop_engine
    finally:
        await http.close()
        await runner.cleanup()
        await pool.close()
        await engine.cleanup()


async def samples(gateway, name: str) -> dict[tuple, float]:
    """`/metrics`' samples of `name`: sorted labels -> value."""
    async with gateway.http.get(f"{gateway.url}/metrics") as reply:
        text = await reply.text()
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


async def admin(gateway, method: str, path: str, body: dict | None = None) -> dict:
    async with gateway.http.request(method, f"{gateway.url}{path}", json=body,
                                    headers=gateway.admin) as reply:
        assert reply.status < 400, await reply.text()
        return await reply.json()


async def close_as_crashed(gateway, session_id: str) -> dict:
    """Closes the session as a scaffold runner would after its scaffold exited non-zero."""
    return await admin(gateway, "POST", f"/admin/sessions/{session_id}/close",
                       {"reward": 0.0, "meta": {"cause": "crashed", "infra_failure": False,
                                                "error": ""}})


async def stream_openai(session: dict, text_came: asyncio.Event | None = None) -> None:
    """A streamed chat call by the openai SDK; `text_came` is set at its first text."""
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for chunk in stream:
            if text_came is not None and chunk.choices and chunk.choices[0].delta.content:
                text_came.set()
    finally:
        await client.close()


async def stream_anthropic(session: dict, text_came: asyncio.Event | None = None) -> None:
    """A streamed message by the anthropic SDK; `text_came` is set at its first text."""
    client = anthropic.AsyncAnthropic(base_url=session["base_url"].removesuffix("/v1"),
                                      api_key=session["api_key"], max_retries=0)
    try:
        async with client.messages.stream(model="m", max_tokens=64, messages=[
                {"role": "user", "content": "hi"}]) as stream:
            async for _text in stream.text_stream:
                if text_came is not None:
                    text_came.set()
    finally:
        await client.close()


@pytest.mark.parametrize(("api", "call", "status"), [("chat", stream_openai, 503),
                                                      ("messages", stream_anthropic, 529)])
async def test_a_stream_ended_by_an_error_event_counts_as_its_error_and_fails_the_session(
        tiny_model_dir, tmp_path, scripted, renderer, api, call, status):
    async with gateway_losing_its_engine(tiny_model_dir, tmp_path / "store",
                                         scripted) as (gateway, stop_engine):
        session = await gateway.open_session(group="lost")
        scripted.delay_s = 0.05
        script(scripted, renderer, "a reply cut short by its engine " * 20)
        text_came = asyncio.Event()
        streaming = asyncio.ensure_future(call(session, text_came))
        await asyncio.wait_for(text_came.wait(), 60)   # a bound on waiting only
        await stop_engine()   # the client has the 200 head and some text
        with pytest.raises((openai.APIError, anthropic.APIError)):
            await streaming   # no engine to resume on: the error event ends the stream

        calls = await samples(gateway, "undertow_calls_total")
        assert calls == {(("api", api), ("status", str(status))): 1.0}   # not a 200
        shown = await admin(gateway, "GET", f"/admin/sessions/{session['session_id']}")
        reason = f"{status} Unavailable in a stream"
        assert shown["infra_errors"] == {reason: 1}

        closed = await close_as_crashed(gateway, session["session_id"])
        assert closed["meta"]["infra_failure"] is True
        assert closed["meta"]["cause"] == "error:gateway"
        assert closed["meta"]["scaffold_cause"] == "crashed"
        assert closed["meta"]["infra_errors"] == {reason: 1}
        assert reason in closed["meta"]["error"]
        tree = gateway.tree("lost")   # what the learner reads, as the store replays it
        assert tree.sessions[session["session_id"]].meta == closed["meta"]
        assert valid_sessions(tree) == {} and infra_failures(tree) == {"error:gateway": 1}
        closes = await samples(gateway, "undertow_sessions_closed_total")
        assert closes == {(("cause", "error:gateway"), ("infra_failure", "true")): 1.0}


async def test_no_engine_is_a_503_or_529_noted_and_a_bad_request_is_not(make_gateway):
    gateway = await make_gateway([DEAD_ENGINE_URL])
    session = await gateway.open_session(group="dead")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    with pytest.raises(openai.BadRequestError):   # the policy's request: a prompt too long
        await client.chat.completions.create(model="m", max_tokens=10**7, messages=[
            {"role": "user", "content": "hi"}])
    shown = await admin(gateway, "GET", f"/admin/sessions/{session['session_id']}")
    assert shown["infra_errors"] == {}
    with pytest.raises(openai.InternalServerError) as refused:
        await client.chat.completions.create(model="m", messages=[
            {"role": "user", "content": "hi"}])
    await client.close()
    assert refused.value.status_code == 503
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        await stream_anthropic(session)   # refused before its first byte
    assert overloaded.value.status_code == 529

    shown = await admin(gateway, "GET", f"/admin/sessions/{session['session_id']}")
    assert shown["infra_errors"] == {"503 Unavailable": 1, "529 Unavailable": 1}
    calls = await samples(gateway, "undertow_calls_total")
    assert calls == {(("api", "chat"), ("status", "400")): 1.0,
                     (("api", "chat"), ("status", "503")): 1.0,
                     (("api", "messages"), ("status", "529")): 1.0}
    closed = await close_as_crashed(gateway, session["session_id"])
    assert closed["meta"]["cause"] == "error:gateway"
    assert gateway.tree("dead").sessions[session["session_id"]].meta["infra_errors"] == {
        "503 Unavailable": 1, "529 Unavailable": 1}


async def test_a_429_fails_its_session_and_not_the_session_being_served(make_gateway,
                                                                        scripted, renderer):
    gateway = await make_gateway([scripted.url], router=RouterConfig(
        max_in_flight_per_engine=1, admission_wait_s=0))   # refused at once
    served, refused = [await gateway.open_session(group="busy") for _ in range(2)]
    scripted.delay_s = 0.05
    script(scripted, renderer, "a slow reply " * 10)
    clients = [openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
               for s in (served, refused)]
    first = asyncio.ensure_future(clients[0].chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]))
    while not scripted.streaming:   # the first call holds the engine's one place
        await asyncio.sleep(0.01)
    with pytest.raises(openai.RateLimitError):
        await clients[1].chat.completions.create(model="m", messages=[
            {"role": "user", "content": "hi"}])
    await first
    for client in clients:
        await client.close()

    for session, errors in ((served, {}), (refused, {"429 Busy": 1})):
        closed = await close_as_crashed(gateway, session["session_id"])
        assert closed["infra_errors"] == errors
        assert closed["meta"]["infra_failure"] is bool(errors)
    tree = gateway.tree("busy")
    assert valid_sessions(tree) == {served["session_id"]: 0.0}
    assert tree.sessions[refused["session_id"]].meta["cause"] == "error:gateway"
