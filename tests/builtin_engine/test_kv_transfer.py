"""Undertow's KV-transfer extension of the built-in engine (`undertow_kv.py`): a sequence's KV
exported from one engine and imported into another continues exactly as if it had never
moved, with the target prefilling nothing of the history; bad payloads are refused with 400."""

import json
import struct

import aiohttp
import pytest
import torch
from safetensors.torch import load, save

from tests.builtin_engine.wire import generate, get, post, prompt, stream
from undertow.gateway.engines.protocol import EngineRejected
from undertow.gateway.engines.sglang import KVPayload, SGLangDriver

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NUM_TOKENS = 40


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir, start_engine):
    with start_engine(tiny_model_dir) as source, start_engine(tiny_model_dir) as target:
        yield source, target


def logprobs_of(reply: dict) -> list[float]:
    return [entry[0] for entry in reply["meta_info"]["output_token_logprobs"]]


async def reference(session, url: str, input_ids: list[int], rid: str) -> dict:
    return await generate(session, url, rid=rid, input_ids=input_ids, return_logprob=True,
                          sampling_params={**GREEDY, "max_new_tokens": NUM_TOKENS})


async def test_finished_sequence_continues_on_target_as_if_never_moved(two_engines):
    source_url, target_url = two_engines
    ids = prompt(1, 300)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        expected = await reference(session, source_url, ids, "reference-1")
        head = expected["output_ids"][:15]
        payload = await source.export_kv(input_ids=ids + head)
        assert (payload.start, payload.end) == (0, len(ids) + 15)
        assert await target.import_kv(payload) == len(ids) + 15
        tail = await generate(session, target_url, input_ids=ids + head, return_logprob=True,
                              sampling_params={**GREEDY, "max_new_tokens": NUM_TOKENS - 15})
    # All but the last token, whose logits the target must compute anyway.
    assert tail["meta_info"]["cached_tokens"] == len(ids) + 14
    assert head + tail["output_ids"] == expected["output_ids"]
    assert logprobs_of(tail) == pytest.approx(logprobs_of(expected)[15:], abs=1e-4)


async def test_staged_copy_of_a_running_request_then_delta(two_engines):
    """Stage 1 by rid while the source decodes; abort; the delta from the source's cache."""
    source_url, target_url = two_engines
    ids = prompt(2, 500)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        expected = await reference(session, target_url, ids, "reference-2")
        await target.flush_cache()
        stages: list[KVPayload] = []

        async def copy_then_abort(chunk):
            done = chunk["meta_info"]["completion_tokens"]
            if done >= 5 and not stages:
                stages.append(await source.export_kv(rid="running"))
                await target.import_kv(stages[0])
            elif done >= 12 and len(stages) == 1:
                stages.append(None)
                await post(session, source_url, "/abort_request", {"rid": "running"})

        chunks = await stream(session, source_url, on_chunk=copy_then_abort, rid="running",
                              input_ids=ids, return_logprob=True,
                              sampling_params={**GREEDY, "max_new_tokens": 1000})
        partial = chunks[-2]["output_ids"]
        assert chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        first = stages[0]
        assert first.start == 0 and len(ids) + 4 <= first.end < len(ids) + len(partial)
        delta = await source.export_kv(input_ids=ids + partial, start=first.end)
        assert delta.end == len(ids) + len(partial) - 1
        assert await target.import_kv(delta) == delta.end
        tail = await generate(session, target_url, input_ids=ids + partial, return_logprob=True,
                              sampling_params={**GREEDY,
                                               "max_new_tokens": NUM_TOKENS - len(partial)})
    assert tail["meta_info"]["cached_tokens"] == len(ids) + len(partial) - 1
    assert partial + tail["output_ids"] == expected["output_ids"]
    num_done = len(partial)
    assert logprobs_of(chunks[-2]) == pytest.approx(logprobs_of(expected)[:num_done], abs=1e-4)
    assert logprobs_of(tail) == pytest.approx(logprobs_of(expected)[num_done:], abs=1e-4)


async def test_export_of_unknown_rid_or_past_the_cache_is_refused(two_engines):
    source_url, _ = two_engines
    async with SGLangDriver(source_url) as source:
        with pytest.raises(EngineRejected) as unknown:
            await source.export_kv(rid="never-sent")
        with pytest.raises(EngineRejected) as too_far:
            await source.export_kv(input_ids=prompt(99, 20), start=5)
    assert unknown.value.status == 404 and "no running request" in unknown.value.message
    assert too_far.value.status == 409 and "fewer than start=5" in too_far.value.message


async def test_delta_without_its_first_stage_is_refused(two_engines):
    source_url, target_url = two_engines
    ids = prompt(3, 64)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source, \
            SGLangDriver(target_url) as target:
        await generate(session, source_url, input_ids=ids,
                       sampling_params={**GREEDY, "max_new_tokens": 4})
        await target.flush_cache()
        delta = await source.export_kv(input_ids=ids, start=32)
        with pytest.raises(EngineRejected) as refused:
            await target.import_kv(delta)
    assert refused.value.status == 409
    assert "import the earlier stage first" in refused.value.message


async def test_kv_of_other_weights_is_refused(two_engines, start_engine, other_tiny_model_dir):
    source_url, _ = two_engines
    ids = prompt(4, 32)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source:
        await generate(session, source_url, input_ids=ids,
                       sampling_params={**GREEDY, "max_new_tokens": 2})
        payload = await source.export_kv(input_ids=ids)
        with start_engine(other_tiny_model_dir) as other_url:
            async with SGLangDriver(other_url) as other:
                with pytest.raises(EngineRejected) as refused:
                    await other.import_kv(payload)
                info = await get(session, other_url, "/get_server_info")
    assert refused.value.status == 400 and "other weights" in refused.value.message
    assert info["num_cached_tokens"] == 0


def forged(payload: KVPayload, **changes) -> bytes:
    """The payload with its tensors or metadata replaced."""
    (size,) = struct.unpack("<Q", payload.data[:8])
    metadata = json.loads(payload.data[8:8 + size])["__metadata__"]
    tensors = load(payload.data)
    tensors.update({k: v for k, v in changes.items() if isinstance(v, torch.Tensor)})
    metadata.update({k: v for k, v in changes.items() if isinstance(v, str)})
    return save(tensors, metadata)


@pytest.mark.parametrize(("change", "message"), [
    ("dtype", "dtype torch.float16"),
    ("shape", "has shape"),
    ("version", "weight version"),
    ("garbage", "not an Undertow KV payload"),
    ("format", "format"),
])
async def test_bad_payload_is_a_400_saying_what_differs(two_engines, change, message):
    source_url, target_url = two_engines
    ids = prompt(5, 16)
    async with aiohttp.ClientSession() as session, SGLangDriver(source_url) as source:
        await generate(session, source_url, input_ids=ids,
                       sampling_params={**GREEDY, "max_new_tokens": 2})
        payload = await source.export_kv(input_ids=ids)
        kv = load(payload.data)["kv"]
        body = {
            "dtype": lambda: forged(payload, kv=kv.half()),
            "shape": lambda: forged(payload, kv=kv[:, :, :, :, :32].contiguous()),
            "version": lambda: forged(payload, weight_version="12345"),
            "garbage": lambda: struct.pack("<Q", 8) + b"not json",
            "format": lambda: forged(payload, format="other/9"),
        }[change]()
        async with session.post(target_url + "/undertow/import_kv", data=body) as reply:
            status, text = reply.status, await reply.text()
    assert status == 400
    assert message in json.loads(text)["error"]["message"]


async def test_server_info_names_the_extension(two_engines):
    async with SGLangDriver(two_engines[0]) as driver:
        assert await driver.supports_kv_transfer()
