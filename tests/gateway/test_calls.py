"""`CallRunner` behaviour that spans requests: an SDK retry that arrives while its
original is still generating waits for it, gets its reply, and nothing is generated
or recorded twice; a retry whose original was abandoned is generated once."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.gateway.capture import calls_of, captured
from tests.gateway.test_api_scripted import script
from undertow.gateway.front.app import RUNNER_KEY, SESSIONS_KEY
from undertow.gateway.front.calls import CallRequest, Delta, SamplingParams

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


async def test_a_reply_not_streamed_is_decoded_and_parsed_once(gateway, scripted, renderer):
    """The engine streams token by token; a reply that is not streamed takes the tokens
    when the engine is done, as one delta (the reply kept for a retry shows it), where a
    streamed one takes them as they come."""
    scripted.delay_s = 0.01
    session_id = (await gateway.open_session())["session_id"]
    session = gateway.app[SESSIONS_KEY].get(session_id)
    runner = gateway.app[RUNNER_KEY]
    text = "a reply of many tokens that the engine sends one by one"
    num_tokens = len(renderer.encode(text)) + 1  # and the stop token
    sizes = {}
    for stream in (False, True):
        script(scripted, renderer, text)
        call = CallRequest(api="chat", model="m", sampling=SamplingParams(max_new_tokens=None),
                           fingerprint=str(stream),
                           messages=[{"role": "user", "content": f"stream: {stream}"}])
        if stream:
            _ = [item async for item in runner.stream(session, call)]
        else:
            outcome = await runner.complete(session, call)
            assert outcome.choices[0].message["content"] == text
        sizes[stream] = [len(item.token_ids) for item in session.replies[str(stream)]
                         if isinstance(item, Delta)]
    assert sizes[False] == [num_tokens, 0]
    assert len(sizes[True]) > 3 and sum(sizes[True]) == num_tokens


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


SYSTEM = {"role": "system", "content": "You are the main agent."}
LONG = "the first call's long reply, still being sampled " * 4
SHORT = "short"


def conversations() -> dict[str, list[dict]]:
    """The calls of the labelling tests, by name: `main` and its exact re-send `again`,
    `side` (another first message: a sub-agent), `edited` (main's task edited: a
    rewrite) and `next` (main's next turn, after its reply)."""
    main = [SYSTEM, {"role": "user", "content": "fix the bug"}]
    return {"main": main, "again": list(main),
            "side": [{"role": "system", "content": "You name conversations."},
                     {"role": "user", "content": "name it"}],
            "edited": [SYSTEM, {"role": "user", "content": "fix the other bug"}],
            "next": [*main, {"role": "assistant", "content": LONG},
                     {"role": "user", "content": "and now?"}]}


async def labels_of(gateway, scripted, renderer, steps: list[list[str]]
                    ) -> list[tuple[str | None, list[int]]]:
    """Runs the named calls in a new session, step after step; the calls of one step
    overlap: each starts once the one before it has reached the engine, while `main`
    (whose reply is long; the others' are short) still generates. Returns each call's
    (branch label, prompt IDs) in start order."""
    session = await gateway.open_session()
    url = f"{session['base_url']}/chat/completions"
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    rids_before = set(scripted.sent)
    for step in steps:
        pending = []
        for name in step:
            script(scripted, renderer, LONG if name == "main" else SHORT)
            num_requests = scripted.num_requests
            pending.append(asyncio.create_task(post(
                gateway, url, {"model": "m", "messages": conversations()[name]}, headers)))
            while scripted.num_requests == num_requests:  # it has reached the engine
                await asyncio.sleep(0.005)
        await asyncio.gather(*pending)
    tree = gateway.tree()
    calls = {call.call_id: call for call in tree.calls}
    started = [rid for rid in scripted.sent if rid not in rids_before]  # in start order
    assert len(started) == sum(map(len, steps))
    return [(calls[rid].branch, captured(tree, rid).prompt_ids) for rid in started]


@pytest.mark.parametrize(("overlapping", "expected"), [
    ([["main", "again"]], [None, "retry"]),
    ([["main", "side"]], [None, "subagent"]),
    ([["main", "edited"]], [None, "rewrite"]),
    # side starts while main generates and finishes first; next continues main, an older
    # conversation than the last one started, as it does when side starts after main ends
    ([["main", "side"], ["next"]], [None, "subagent", "subagent"]),
])
async def test_a_call_that_overlaps_earlier_ones_is_labelled_as_if_they_had_finished(
        gateway, scripted, renderer, overlapping, expected):
    scripted.delay_s = 0.02  # per token: main generates for about a second
    one_by_one = [[name] for step in overlapping for name in step]
    sequential = await labels_of(gateway, scripted, renderer, one_by_one)
    overlapped = await labels_of(gateway, scripted, renderer, overlapping)
    assert [label for label, _ in sequential] == expected
    assert [label for label, _ in overlapped] == expected
    # and the same prompt IDs: a retry of a call still generating reuses its prompt's IDs
    assert [ids for _, ids in overlapped] == [ids for _, ids in sequential]


async def test_the_engine_gets_the_calls_sampling_params_byte_for_byte(gateway, scripted,
                                                                         renderer):
    """The sampling parameters an API call sets reach the engine in SGLang's form, in one
    fixed byte layout (the one before they became one typed value), with the call's seed
    plus the choice's index, and are recorded with the call."""
    scripted.keep_bodies = True
    session = await gateway.open_session()
    script(scripted, renderer, "a reply")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
            "temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 41, "stop": ["END"],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": {"type": "object"}}}}
    await post(gateway, f"{session['base_url']}/chat/completions", body,
               {"Authorization": f"Bearer {session['api_key']}"})
    (sent,) = scripted.bodies
    prompt = json.loads(sent)["input_ids"]
    rid = json.loads(sent)["rid"]
    assert sent == (
        b'{"input_ids":' + json.dumps(prompt, separators=(",", ":")).encode() + b',"rid":"'
        + rid.encode() + b'","sampling_params":{"max_new_tokens":7,"temperature":0.5,'
        b'"top_p":0.9,"top_k":20,"min_p":0.0,"ignore_eos":false,"skip_special_tokens":true,'
        b'"stop":["END"],"json_schema":"{\\"type\\": \\"object\\"}","sampling_seed":41},'
        b'"stream":true,"return_logprob":true,"logprob_start_len":-1}')
    (call,) = [captured(gateway.tree(), c) for c in calls_of(gateway.tree(),
                                                             session["session_id"])]
    assert call.meta["sampling"] == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                     "top_k": 20, "stop": ["END"], "sampling_seed": 41,
                                     "json_schema": '{"type": "object"}'}
    assert list(call.meta["sampling"]) == ["max_new_tokens", "temperature", "top_p", "top_k",
                                           "stop", "sampling_seed", "json_schema"]
