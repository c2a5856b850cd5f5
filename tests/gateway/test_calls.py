"""`CallRunner` behaviour that spans requests: an SDK retry that arrives while its
original is still generating waits for it, gets its reply, and nothing is generated
or recorded twice; a retry whose original was abandoned is generated once."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.gateway.capture import calls_of
from tests.gateway.test_api_scripted import script

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def post(gateway, url: str, body: dict, headers: dict) -> dict:
    async with gateway.http.post(url, json=body, headers=headers) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


@pytest.mark.parametrize("stream", [False, True])
async def test_retry_while_original_generates_is_not_generated_twice(gateway, scripted,
                                                                     renderer, stream):
    scripted.delay_s = 0.05
    session = await gateway.open_session()
    url = f"{session['base_url']}/chat/completions"
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "slow"}], "stream": stream}
    script(scripted, renderer, "a reply that takes a while to sample")
    original = asyncio.create_task(
        gateway.http.post(url, json=body, headers=headers))
    while not scripted.sent:  # the original has reached the engine
        await asyncio.sleep(0.01)
    retry = await gateway.http.post(url, json=body,
                                    headers={**headers, "x-stainless-retry-count": "1"})
    first = await (await original).read()
    again = await retry.read()
    assert retry.status == 200
    assert scripted.num_requests == 1
    assert len(calls_of(gateway.tree(), session["session_id"])) == 1
    if not stream:
        assert first == again
    else:
        assert streamed_text(again) == streamed_text(first) == (
            "a reply that takes a while to sample")


def streamed_text(body: bytes) -> str:
    """The content of a chat completion's SSE stream."""
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: {")]
    return "".join(event["choices"][0]["delta"].get("content") or ""
                   for event in events if event.get("choices"))


async def test_retry_of_an_abandoned_original_is_generated_once(gateway, scripted, renderer):
    scripted.delay_s = 0.05
    session = await gateway.open_session()
    url = f"{session['base_url']}/chat/completions"
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hang up"}], "stream": True}
    script(scripted, renderer, "the first try is cut off by its client " * 3)
    script(scripted, renderer, "the retry")
    async with gateway.http.post(url, json=body, headers=headers) as reply:
        await reply.content.readline()  # the client gives up after the first event
        reply.close()
    async with gateway.http.post(url, json={**body, "stream": False},
                                 headers={**headers, "x-stainless-retry-count": "1"}) as reply:
        assert reply.status == 200
        answer = await reply.json()
    assert answer["choices"][0]["message"]["content"] == "the retry"
    assert len(calls_of(gateway.tree(), session["session_id"])) == 1
