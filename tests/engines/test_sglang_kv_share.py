"""KV handed between SGLang servers through HiCache's shared storage (issue 36, item 7),
against `sglang_faithful.FaithfulSGLang` (its docstring, item 11, names SGLang 0.5.23's
code): two servers launched with the same `SGLangLauncher.kv_share_dir` share one storage.
A session drained with `migrate` from one resumes on the other with its history loaded
from storage, not prefilled, and its tokens are those a right KV gives; after a weight
update no server loads the KV the old weights computed, because the driver salts the
cache with the weight version.

Each test fails on the gateway as it was before (no salt, no storage count).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from tests.engines.sglang_faithful import FaithfulSGLang, Request, serve_faithful
from tests.engines.sglang_types import find_wheel, load_api_types
from tests.gateway.capture import calls_of, captured
from tests.gateway.conftest import ADMIN_TOKEN, start_gateway
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.front.app import POOL_KEY, STORE_KEY

pytestmark = pytest.mark.asyncio(loop_scope="session")

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
VOCAB = 8192  # the tiny model's tokenizer
PAGE = 64
INPUT_IDS = [100 + (i * 37) % 5000 for i in range(300)]
MAX_TOKENS = 40


def sharing_pair(storage: dict) -> list[FaithfulSGLang]:
    return [FaithfulSGLang(vocab_size=VOCAB, kv_storage=storage, step_delay_s=0.02)
            for _ in range(2)]


def reference_tokens(weights: str, input_ids: list[int], seed: int, num: int) -> list[int]:
    """What a server with the right KV samples: the fake's draw, on a server of its own."""
    reference = FaithfulSGLang(vocab_size=VOCAB, weights=weights)
    request = Request("ref", list(input_ids), {"sampling_seed": seed}, False, False, 0)
    for _ in range(num):
        request.output_ids.append(reference.draw(request)[0])
    return request.output_ids


def whole_pages(num_tokens: int) -> int:
    """The tokens of the whole pages before a prompt's last token (the one it computes)."""
    return (num_tokens - 1) // PAGE * PAGE


@contextlib.asynccontextmanager
async def served(servers: list[FaithfulSGLang]):
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_faithful(s)) for s in servers]


async def test_a_drained_session_resumes_from_shared_storage_with_token_truth(
        tiny_model_dir, tmp_path):
    storage: dict[str, str] = {}
    servers = sharing_pair(storage)
    async with served(servers) as urls:
        app, runner, url = await start_gateway(urls, tiny_model_dir, tmp_path)
        try:
            async with aiohttp.ClientSession() as http:
                call_id, session_id = await drained_call(app, url, http)
        finally:
            await runner.cleanup()
    source, target = servers if servers[0].bodies.get("/abort_request") else servers[::-1]
    (first,) = source.bodies["/generate"]
    (resumed,) = target.bodies["/generate"]
    assert first["cache_salt"] == resumed["cache_salt"] == "0"  # the weight version
    num_partial = len(resumed["input_ids"]) - len(INPUT_IDS)
    assert num_partial >= 5
    call = captured(app[STORE_KEY].tree("g"), call_id)
    assert call.prompt_ids == INPUT_IDS
    assert resumed["input_ids"] == INPUT_IDS + call.completion_ids[:num_partial]
    expected = (reference_tokens("/models/a", INPUT_IDS, first["sampling_params"]["sampling_seed"],
                                 num_partial)
                + reference_tokens("/models/a", resumed["input_ids"],
                                   resumed["sampling_params"]["sampling_seed"],
                                   MAX_TOKENS - num_partial))
    assert call.completion_ids == expected
    # The history came from storage: every whole page the source wrote through.
    loaded = whole_pages(len(resumed["input_ids"]))
    final = target.replies[-1]["meta_info"]
    assert final["cached_tokens_details"]["storage"] == loaded > len(INPUT_IDS) - PAGE
    assert target.stale_kv_loads == source.stale_kv_loads == 0
    assert call.meta["storage_tokens"] == loaded
    metrics = app[POOL_KEY].metrics.resume_prompt_tokens
    assert {source_: metrics.value(cause="migrate", source=source_)
            for source_ in ("storage", "cache", "prefill")} == {
        "storage": loaded, "cache": 0, "prefill": len(resumed["input_ids"]) - loaded}
    assert call.meta["cached_tokens"] == 0 and session_id  # the first attempt's: none


async def drained_call(app, url: str, http: aiohttp.ClientSession) -> tuple[str, str]:
    """One streamed completion, its engine drained with `migrate` after 5 chunks."""
    async with http.post(f"{url}/admin/sessions", json={"group": "g"}, headers=ADMIN) as reply:
        session = await reply.json()
    pool = app[POOL_KEY]
    num_chunks = 0
    async with http.post(f"{session['base_url']}/completions", json={
            "model": "m", "prompt": INPUT_IDS, "max_tokens": MAX_TOKENS, "stream": True},
            headers={"Authorization": f"Bearer {session['api_key']}"}) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if not line.startswith(b"data: {"):
                continue
            num_chunks += 1
            if num_chunks == 5:
                (busy,) = [e for e in pool.describe() if e["num_in_flight"] == 1]
                async with http.post(f"{url}/admin/engines/{busy['id']}/drain",
                                     json={"migrate": True}, headers=ADMIN) as drained:
                    assert drained.status == 200, await drained.text()
    (call_id,) = calls_of(app[STORE_KEY].tree("g"), session["session_id"])
    return call_id, session["session_id"]


async def weight_update_between_calls() -> tuple[list[FaithfulSGLang], list]:
    """A prompt on the first server, a variant of it on the second (version 0), both servers
    updated to version 1, the prompt again on the second: the servers and three results."""
    servers = sharing_pair({})
    prompt = tuple(INPUT_IDS)
    params = SamplingParams(max_new_tokens=4, sampling_seed=7)
    async with served(servers) as urls, SGLangDriver(urls[0]) as first, \
            SGLangDriver(urls[1]) as second:
        results = [await first.generate(GenerateRequest(input_ids=prompt,
                                                        sampling_params=params))]
        results.append(await second.generate(GenerateRequest(
            input_ids=prompt[:-1] + (4321,), sampling_params=params)))
        await asyncio.gather(first.update_weights_from_disk("/models/b", "1"),
                             second.update_weights_from_disk("/models/b", "1"))
        results.append(await second.generate(GenerateRequest(input_ids=prompt,
                                                             sampling_params=params)))
    return servers, results


async def test_after_a_weight_update_no_server_loads_the_old_versions_kv():
    servers, (_, same_version, after_update) = await weight_update_between_calls()
    assert same_version.storage_tokens == whole_pages(len(INPUT_IDS))  # shared at version 0
    assert [body.get("cache_salt") for body in servers[1].bodies["/generate"]] == ["0", "1"]
    assert servers[1].stale_kv_loads == 0
    assert not after_update.storage_tokens and after_update.cached_tokens == 0
    assert after_update.output_ids == reference_tokens("/models/b", INPUT_IDS, 7, 4)


async def test_the_salted_bodies_and_storage_replies_are_sglangs_own():
    """`cache_salt` is a field of SGLang 0.5.23's `/generate` request type (a string: its
    type refuses a number), and the replies with `cached_tokens_details` are of its reply
    type (`sglang_types.py`, read from the wheel)."""
    wheel = find_wheel()
    if wheel is None or not wheel.exists():
        pytest.skip("SGLang 0.5.23's wheel is not in .cache/sglang: run `make "
                    "setup-sglang-types` (or set UNDERTOW_SGLANG_WHEEL)")
    api = load_api_types(wheel)
    servers, _ = await weight_update_between_calls()
    bodies = [body for server in servers for body in server.bodies["/generate"]]
    replies = [reply for server in servers for reply in server.replies]
    assert all("cache_salt" in body for body in bodies)
    assert any("cached_tokens_details" in reply["meta_info"] for reply in replies)
    for body in bodies:
        api.GenerateRequest.from_json_value(body)  # raises JsonContractError
    with pytest.raises(Exception, match="StringOrList"):
        api.GenerateRequest.from_json_value({**bodies[0], "cache_salt": 0})
    for reply in replies:
        api.GenerateResponse.from_json_value(reply)
