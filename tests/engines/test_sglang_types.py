"""Every body the SGLang driver sends, checked against SGLang 0.5.23's own request types, and
every reply of the faithful test server against SGLang's reply type (`sglang_types.py` reads
both from SGLang's wheel): a field SGLang renames fails here, not on a GPU.

Skips, saying so, where the wheel has not been downloaded (`make setup-sglang-types`).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.engines.sglang_faithful import FaithfulSGLang, serve_faithful
from tests.engines.sglang_types import IoStructs, find_wheel, load_api_types, read_source
from undertow.gateway.engines.protocol import GenerateRequest, SamplingParams
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.front.toolparsers import PARSERS, forced_structural_tag

ASYNC = pytest.mark.asyncio(loop_scope="session")

PROMPT = (21, 22, 23, 24)
FORCED_TAG = forced_structural_tag(PARSERS["hermes"], [{"type": "function", "function": {
    "name": "bash", "parameters": {"type": "object"}}}], None)
CONTROL_STRUCTS = {  # path -> the io_struct struct its body is parsed as (http_server.py)
    "/abort_request": "AbortReq",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/flush_cache": "FlushCacheReqInput",
}


@pytest.fixture(scope="module")
def wheel():
    path = find_wheel()
    if path is None or not path.exists():
        pytest.skip("SGLang 0.5.23's wheel is not in .cache/sglang: run `make "
                    "setup-sglang-types` (or set UNDERTOW_SGLANG_WHEEL)")
    return path


@pytest.fixture(scope="module")
def api(wheel):
    return load_api_types(wheel)


@pytest.fixture(scope="module")
def io_structs(wheel) -> IoStructs:
    return IoStructs(read_source(wheel, "sglang/srt/managers/io_struct.py"))


async def drive_everything(driver: SGLangDriver, server: FaithfulSGLang) -> None:
    """Every driver method that talks to SGLang, each request form included."""
    await driver.generate(GenerateRequest(input_ids=PROMPT, return_logprob=True,
                                          sampling_params=SamplingParams(
                                              max_new_tokens=4, stop=("x",), top_k=5,
                                              stop_token_ids=(7,), sampling_seed=3)))
    await driver.generate(GenerateRequest(text="hello", sampling_params=SamplingParams(
        max_new_tokens=2, temperature=0.0)))
    await driver.generate(GenerateRequest(input_ids=PROMPT, sampling_params=SamplingParams(
        max_new_tokens=2, structural_tag=FORCED_TAG)))  # a forced tool call's constraint
    [chunk async for chunk in driver.generate_stream(GenerateRequest(
        input_ids=PROMPT, sampling_params=SamplingParams(max_new_tokens=3)))]
    await driver.abort("no-such-request")
    await driver.abort(None)
    for mode in ("abort", "in_place", "retract"):
        await driver.pause(mode)
        await driver.resume()
    await driver.flush_cache()
    await driver.update_weights_from_disk("/models/b")
    held = asyncio.create_task(driver.generate(GenerateRequest(
        input_ids=PROMPT, rid="held", sampling_params=SamplingParams(max_new_tokens=50))))
    while "held" not in server.requests:
        await asyncio.sleep(0.01)
    await driver.pause("in_place")
    await driver.update_weights_from_disk("/models/c", "2")  # retracts, flushes, sets "2"
    await driver.resume()
    await held
    await driver.health()
    await driver.model_info()
    await driver.server_info()


@ASYNC
async def test_every_body_the_driver_sends_is_a_valid_sglang_request(api, io_structs):
    server = FaithfulSGLang()
    async with serve_faithful(server) as url, SGLangDriver(url) as driver:
        await drive_everything(driver, server)
    assert set(server.bodies) == {"/generate", *CONTROL_STRUCTS}
    for body in server.bodies["/generate"]:
        api.GenerateRequest.from_json_value(body)  # raises JsonContractError
        api.SamplingParams.from_json_value(body["sampling_params"])  # unknown keys refused
    for body in server.bodies["/abort_request"]:
        api.AbortRequest.from_json_value(body)
    problems = [problem for path, struct in CONTROL_STRUCTS.items()
                for body in server.bodies[path] for problem in io_structs.problems(struct, body)]
    assert problems == []


@ASYNC
async def test_the_faithful_servers_replies_are_valid_sglang_replies(api):
    server = FaithfulSGLang(incremental=True, null_logprob_at=3)
    async with serve_faithful(server) as url, SGLangDriver(url) as driver:
        await driver.generate(GenerateRequest(input_ids=PROMPT, return_logprob=True,
                                              sampling_params=SamplingParams(max_new_tokens=2)))
        chunks = []
        async for chunk in driver.generate_stream(GenerateRequest(
                input_ids=PROMPT, rid="queued", sampling_params=SamplingParams(
                    max_new_tokens=1000))):
            chunks.append(chunk)
            if len(chunks) == 2:
                await driver.pause("retract")
                await driver.abort("queued")
        await driver.resume()
    assert chunks[-1].finish_reason.type == "abort"
    assert any("prompt_tokens" not in reply["meta_info"] for reply in server.replies)
    for reply in server.replies:
        api.GenerateResponse.from_json_value(reply)


def test_a_renamed_field_fails_the_check(api, io_structs):
    """The checks above can fail: names SGLang does not have are refused."""
    with pytest.raises(api.JsonContractError):
        api.SamplingParams.from_json_value({"max_tokens": 5})
    assert io_structs.problems("PauseGenerationReqInput", {"mode": "pause"})
    assert io_structs.problems("UpdateWeightVersionReqInput", {"version": "1"})
    assert io_structs.problems("UpdateWeightFromDiskReqInput", {"path": "/models/b"})
