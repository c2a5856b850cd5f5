"""Control routes of the built-in engine: abort, pause/continue, weight updates, cache bound,
and bad input that gets a 400 without hurting the requests in flight."""

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from tests.builtin_engine.wire import generate, get, greedy, post, prompt, stream

LONG = {"max_new_tokens": 5000, "temperature": 0.0, "ignore_eos": True}


async def wait_until_running(session, url, count: int = 1) -> None:
    for _ in range(1000):
        if (await get(session, url, "/get_server_info"))["num_running_reqs"] >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never started running")


async def test_abort_returns_partial_output_streamed_and_not(builtin_engine_url):
    url = builtin_engine_url
    async with aiohttp.ClientSession() as session:
        async def abort_after_a_few(chunk):
            if chunk["meta_info"]["completion_tokens"] >= 3 and chunk["meta_info"][
                    "finish_reason"] is None:
                await post(session, url, "/abort_request", {"rid": "abort-streamed"})

        chunks = await stream(session, url, on_chunk=abort_after_a_few, rid="abort-streamed",
                              input_ids=prompt(20, 10), sampling_params=LONG)
        whole = asyncio.create_task(generate(session, url, rid="abort-whole",
                                             input_ids=prompt(21, 10), sampling_params=LONG))
        await wait_until_running(session, url)
        status, _ = await post(session, url, "/abort_request", {"rid": "abort-whole"})
        reply = await whole
    assert status == 200
    final = chunks[-2]
    assert chunks[-1] == "[DONE]"
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(final["output_ids"]) < LONG["max_new_tokens"]
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    assert reply["meta_info"]["id"] == "abort-whole"
    assert len(reply["output_ids"]) < LONG["max_new_tokens"]


async def test_pause_abort_aborts_in_flight_and_holds_new_requests(builtin_engine_url):
    url = builtin_engine_url
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.create_task(generate(session, url, input_ids=prompt(22, 10),
                                                 sampling_params=LONG))
        await wait_until_running(session, url)
        try:
            status, body = await post(session, url, "/pause_generation", {"mode": "abort"})
            aborted = await in_flight
            held = asyncio.create_task(generate(session, url, input_ids=prompt(23, 10),
                                                sampling_params=greedy(4)))
            await asyncio.sleep(0.5)
            assert not held.done()
            assert (await get(session, url, "/get_server_info"))["num_waiting_reqs"] == 1
        finally:
            await post(session, url, "/continue_generation")
        released = await held
    assert status == 200 and body["status"] == "ok"
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert released["meta_info"]["finish_reason"]["type"] == "length"


async def test_pause_in_place_keeps_requests_and_continue_finishes_them(builtin_engine_url):
    url = builtin_engine_url
    params = greedy(300, ignore_eos=True)
    input_ids = prompt(24, 10)
    async with aiohttp.ClientSession() as session:
        reference = await generate(session, url, input_ids=input_ids, sampling_params=params)
        await post(session, url, "/flush_cache")
        paused_at = []

        async def pause_once(chunk):
            if not paused_at and chunk["meta_info"]["completion_tokens"] >= 5:
                await post(session, url, "/pause_generation", {"mode": "in_place"})
                paused_at.append(await get(session, url, "/get_server_info"))
                await asyncio.sleep(0.3)
                paused_at.append(await get(session, url, "/get_server_info"))
                await post(session, url, "/continue_generation")

        try:
            chunks = await stream(session, url, on_chunk=pause_once, input_ids=input_ids,
                                  sampling_params=params)
        finally:
            await post(session, url, "/continue_generation")
    before, after = paused_at
    assert before["paused"] and before["num_running_reqs"] == 1
    assert after["num_decode_steps"] == before["num_decode_steps"]
    assert chunks[-2]["output_ids"] == reference["output_ids"]
    assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "length"


async def test_update_weights_from_disk_changes_outputs_and_version(
        start_engine, tiny_model_dir, other_tiny_model_dir):
    input_ids = prompt(25, 12)
    params = greedy(12, ignore_eos=True)
    with start_engine(tiny_model_dir, "weight_version=v0") as url:
        async with aiohttp.ClientSession() as session:
            before = await generate(session, url, input_ids=input_ids, sampling_params=params)
            status, update = await post(session, url, "/update_weights_from_disk", {
                "model_path": str(other_tiny_model_dir), "weight_version": "v1"})
            after = await generate(session, url, input_ids=input_ids, sampling_params=params)
            version = await get(session, url, "/get_weight_version")
            bad_status, bad = await post(session, url, "/update_weights_from_disk",
                                         {"model_path": str(tiny_model_dir / "missing")})
            _, _ = await post(session, url, "/update_weights_from_disk", {
                "model_path": str(tiny_model_dir), "weight_version": "v2"})
            back = await generate(session, url, input_ids=input_ids, sampling_params=params)
    assert status == 200 and update["success"] is True
    assert before["meta_info"]["weight_version"] == "v0"
    assert after["meta_info"]["weight_version"] == "v1" == version["weight_version"]
    assert after["output_ids"] != before["output_ids"]
    assert after["meta_info"]["cached_tokens"] == 0
    assert bad_status == 400 and bad["success"] is False
    assert back["output_ids"] == before["output_ids"]
    assert back["meta_info"]["weight_version"] == "v2"


@pytest.mark.slow
async def test_weight_updates_hand_the_old_weights_memory_back(start_engine, smollm2_dir):
    """An update frees the old weights and the load's buffers, and the engine gives that
    memory back to the system: without it SmolLM2-135M's engine (540 MB of float32 weights)
    grew by 456 MB at its first update (Qwen2.5-Coder-0.5B's by 3.3 GB over six, and an RL
    run's engine was OOM-killed)."""
    params = greedy(4)
    with start_engine(smollm2_dir, "weight_version=v0") as url:
        pid = _engine_pid(smollm2_dir)
        async with aiohttp.ClientSession() as session:
            await generate(session, url, input_ids=prompt(40, 30), sampling_params=params)
            before = _resident_bytes(pid)
            for version in range(1, 4):
                status, update = await post(session, url, "/update_weights_from_disk", {
                    "model_path": str(smollm2_dir), "weight_version": f"v{version}"})
                assert status == 200 and update["success"] is True
                reply = await generate(session, url, input_ids=prompt(40, 30),
                                       sampling_params=params)
                assert reply["meta_info"]["weight_version"] == f"v{version}"
            after = _resident_bytes(pid)
    assert after - before < 150 * 2**20, (before, after)


def _engine_pid(model_dir: Path) -> int:
    """The pid of this process's child serving `model_dir`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended while read
            continue
        if parent == os.getpid() and str(model_dir).encode() in command:
            return int(entry.name)
    raise AssertionError(f"no child process serves {model_dir}")


def _resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


async def test_prefix_cache_stays_under_its_byte_bound(start_engine, tiny_model_dir):
    cache_bytes = 400 * 4096  # about 400 tokens of the tiny model's KV
    with start_engine(tiny_model_dir, f"cache_bytes={cache_bytes}") as url:
        async with aiohttp.ClientSession() as session:
            for i in range(8):
                await generate(session, url, input_ids=prompt(30 + i, 120),
                               sampling_params=greedy(4))
                info = await get(session, url, "/get_server_info")
                assert 0 < info["cache_bytes_used"] <= cache_bytes
            newest = await generate(session, url, input_ids=prompt(37, 120),
                                    sampling_params=greedy(4))
            oldest = await generate(session, url, input_ids=prompt(30, 120),
                                    sampling_params=greedy(4))
    assert newest["meta_info"]["cached_tokens"] >= 119
    assert oldest["meta_info"]["cached_tokens"] == 0


BAD_BODIES = [
    {"input_ids": []},
    {"input_ids": [1, 2, 10**9]},
    {"input_ids": [1, -2]},
    {"input_ids": "not a list"},
    {"input_ids": [1, 2], "text": "both"},
    {},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}},
    {"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}},
    {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
    {"input_ids": [1, 2], "sampling_params": {"no_such_field": 1}},
    {"input_ids": [1, 2], "sampling_params": "greedy"},
    {"input_ids": [1, 2], "stream": "yes"},
    {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": -1},
    {"input_ids": [1, 2], "rid": 7},
]


async def test_bad_input_gets_400_while_a_good_request_streams_on(builtin_engine_url):
    url = builtin_engine_url
    params = greedy(60, ignore_eos=True)
    input_ids = prompt(40, 10)
    async with aiohttp.ClientSession() as session:
        reference = await generate(session, url, input_ids=input_ids, sampling_params=params)
        replies = []

        async def send_bad_inputs(chunk):
            if not replies:
                replies.extend([await post(session, url, "/generate", body)
                                for body in BAD_BODIES])
                async with session.post(url + "/generate", data=b"{not json") as reply:
                    replies.append((reply.status, await reply.json()))

        chunks = await stream(session, url, on_chunk=send_bad_inputs, input_ids=input_ids,
                              sampling_params=params)
    for (status, body), sent in zip(replies, [*BAD_BODIES, "{not json"], strict=True):
        assert status == 400, sent
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], sent
    assert chunks[-2]["output_ids"] == reference["output_ids"]
    assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("route", ["/pause_generation", "/abort_request"])
async def test_bad_control_bodies_get_400(builtin_engine_url, route):
    body = {"mode": "sideways"} if route == "/pause_generation" else {"rid": 5}
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, builtin_engine_url, route, body)
        info = await get(session, builtin_engine_url, "/get_server_info")
    assert status == 400 and "error" in reply
    assert info["paused"] is False
