"""A client that leaves before its reply's end (`api/common.py`, `client_left`): curl with
`--max-time`, the openai SDK closing its stream, aiohttp dropping a response, and a
non-streamed call whose client timed out. Against the gateway in front of the scripted
engine, which notes every `/abort_request` and ends the aborted stream as SGLang does.

Checked: the call counts as a client disconnect, not as a 500 (and no error is logged);
the engine is told to abort the streamed request; the tree keeps only what was recorded
before (a cut stream records nothing, so the session's next call extends its last
finished call); a non-streamed call runs to its end, is recorded, and its SDK's retry is
answered from memory."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.capture import calls_of
from tests.gateway.test_api_scripted import script

pytestmark = pytest.mark.asyncio(loop_scope="session")
LONG_REPLY = "a long answer that the client will not wait for " * 8


async def counts(gateway) -> dict[tuple[str, tuple], float]:
    """`/metrics`' call counters: (sample name, sorted labels) -> value."""
    async with gateway.http.get(f"{gateway.url}/metrics") as reply:
        text = await reply.text()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in ("undertow_calls_total", "undertow_client_disconnects_total")}


async def until(condition, what: str) -> None:
    """Waits for `condition()` (a bool, or an awaitable of one) to hold."""
    for _ in range(500):  # a bound on waiting, not a timing check
        held = condition()
        if await held if asyncio.iscoroutine(held) else held:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


async def disconnects(gateway, api: str) -> float:
    return (await counts(gateway)).get(("undertow_client_disconnects_total",
                                        (("api", api),)), 0)


def headers_of(session: dict) -> dict[str, str]:
    return {"Authorization": f"Bearer {session['api_key']}"}


async def first_call(gateway, session: dict, renderer, scripted) -> list[dict]:
    """One finished call; returns the messages of the next turn (which extend it)."""
    script(scripted, renderer, "Hello there.")
    messages = [{"role": "user", "content": "hi"}]
    async with gateway.http.post(f"{session['base_url']}/chat/completions",
                                 json={"model": "m", "messages": messages},
                                 headers=headers_of(session)) as reply:
        assert reply.status == 200, await reply.text()
        answer = (await reply.json())["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": answer},
            {"role": "user", "content": "tell me more"}]


def assert_no_errors_logged(caplog) -> None:
    errors = [record.getMessage() for record in caplog.records
              if record.levelno >= logging.ERROR]
    assert errors == []


async def test_a_stream_cut_by_curl_is_a_disconnect_its_engine_request_is_aborted(
        gateway, scripted, renderer, caplog):
    caplog.set_level(logging.INFO)
    session = await gateway.open_session()
    messages = await first_call(gateway, session, renderer, scripted)
    scripted.delay_s = 0.05  # per token: the long reply takes ~5 s, curl waits 1 s
    script(scripted, renderer, LONG_REPLY)
    body = json.dumps({"model": "m", "messages": messages, "stream": True})
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sN", "--max-time", "1", f"{session['base_url']}/chat/completions",
        "-H", f"Authorization: Bearer {session['api_key']}", "-H",
        "Content-Type: application/json", "-d", body, stdout=asyncio.subprocess.PIPE)
    out, _ = await curl.communicate()
    assert curl.returncode == 28 and b"data: {" in out  # curl's timeout, mid-stream
    cut = [rid for rid in scripted.sent if rid not in calls_of(gateway.tree(),
                                                                session["session_id"])]
    await until(lambda: scripted.aborted, "the engine was asked to abort")
    await until(lambda: disconnects(gateway, "chat"), "the disconnect was counted")
    assert scripted.aborted == cut and len(cut) == 1  # that request, by its rid

    metrics = await counts(gateway)
    assert metrics == {("undertow_calls_total", (("api", "chat"), ("status", "200"))): 1,
                       ("undertow_client_disconnects_total", (("api", "chat"),)): 1}
    assert_no_errors_logged(caplog)

    # The tree holds the first call only, and the store's log likewise; the session's
    # next call (the same turn again) extends the first call by token truth.
    tree = gateway.tree()
    [first] = calls_of(tree, session["session_id"])
    log_lines = (gateway.store_dir / "g.jsonl").read_text().splitlines()
    assert [json.loads(line)["call_id"] for line in log_lines
            if json.loads(line)["kind"] == "call"] == [first]
    scripted.delay_s = 0.0
    script(scripted, renderer, "Here is more.")
    async with gateway.http.post(f"{session['base_url']}/chat/completions",
                                 json={"model": "m", "messages": messages},
                                 headers=headers_of(session)) as reply:
        assert reply.status == 200
    again = tree.calls[-1]
    assert again.branch is None and again.meta["extends"] == first
    assert again.meta["token_truth"]


async def test_an_sdk_closing_its_stream_is_a_disconnect_in_each_api(gateway, scripted,
                                                                     renderer, caplog):
    caplog.set_level(logging.INFO)
    scripted.delay_s = 0.05
    session = await gateway.open_session()
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"],
                                max_retries=0)
    try:
        script(scripted, renderer, LONG_REPLY)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            break  # the agent stops reading after its first chunk
        await stream.close()
    finally:
        await client.close()
    await until(lambda: len(scripted.aborted) == 1, "the chat stream's abort")
    script(scripted, renderer, LONG_REPLY)
    async with gateway.http.post(f"{session['base_url']}/messages", json={
            "model": "m", "max_tokens": 500, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]},
            headers=headers_of(session)) as reply:
        await reply.content.readline()
        reply.close()  # aiohttp drops the connection
    await until(lambda: len(scripted.aborted) == 2, "the messages stream's abort")
    assert scripted.aborted == list(scripted.sent)
    await until(lambda: disconnects(gateway, "messages"), "the disconnect was counted")
    assert await counts(gateway) == {
        ("undertow_client_disconnects_total", (("api", "chat"),)): 1,
        ("undertow_client_disconnects_total", (("api", "messages"),)): 1}
    assert calls_of(gateway.tree(), session["session_id"]) == []
    assert_no_errors_logged(caplog)


async def test_a_call_not_streamed_runs_to_its_end_and_its_retry_is_answered(
        gateway, scripted, renderer):
    scripted.delay_s = 0.02
    session = await gateway.open_session()
    script(scripted, renderer, LONG_REPLY)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    url = f"{session['base_url']}/chat/completions"
    with pytest.raises(TimeoutError):  # the SDK's timeout: it closes the connection
        async with gateway.http.post(url, json=body, headers=headers_of(session),
                                     timeout=aiohttp.ClientTimeout(total=0.5)) as reply:
            await reply.read()
    await until(lambda: disconnects(gateway, "chat"), "the disconnect was counted")
    assert scripted.aborted == []
    [call_id] = calls_of(gateway.tree(), session["session_id"])
    async with gateway.http.post(url, json=body, headers={
            **headers_of(session), "x-stainless-retry-count": "1"}) as reply:
        answer = await reply.json()
    assert answer["choices"][0]["message"]["content"] == LONG_REPLY
    assert scripted.num_requests == 1 and list(scripted.sent) == [call_id]
    assert (await counts(gateway)) == {
        ("undertow_calls_total", (("api", "chat"), ("status", "200"))): 1,
        ("undertow_client_disconnects_total", (("api", "chat"),)): 1}
