"""The engine protocol's conformance suite: one set of tests, run through the protocol's drivers
against every engine the project drives.

- `builtin`: Undertow's engine on the tiny model (always);
- `vllm`: a real vLLM server on the tiny model, through `VLLMDriver` (marker `vllm`; skips only
  where the vLLM CPU build is absent);
- `sglang`: a real SGLang server given by `--sglang-url` (marker `sglang`), serving the model
  directory given by `--sglang-model` (default: the tiny model of seed 0, which must then be
  built on the same machine, `undertow model init --out DIR`). Start it as `SGLangLauncher`
  does (`python -m sglang.launch_server --model-path DIR`, with
  `--enable-deterministic-inference` where its attention backend allows it; on a CPU
  `--device cpu --attention-backend torch_native` and `SGLANG_USE_CPU_ENGINE=1`). The
  tokenizer, config and the second checkpoint of the weight tests come from that directory
  (`second_checkpoint`: its weights with noise added). What a server without deterministic
  inference cannot do (replay a seed, batch-invariant greedy outputs) is skipped, saying
  so; an out-of-vocabulary prompt ID is not sent to it (it takes SGLang 0.5.23 down; the
  gateway refuses such IDs, `tests/engines/test_sglang_findings.py`).

A test that needs an optional feature declares it with `require(engine, capability)` and
skips, with the reason, on engines whose driver lacks it (see `protocol.CAPABILITIES`).
"""

import asyncio
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from undertow.gateway.engines.protocol import (
    EngineDriver,
    EngineRejected,
    GenerateRequest,
    SamplingParams,
    result_from_chunks,
)
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.engines.vllm import VLLMDriver

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT_TEXT = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n# Tests for the parser"
)
LONG_TEXT = " ".join(f"The parser reads line {i} of the configuration file." for i in range(40))
LONG_RUN = SamplingParams(max_new_tokens=4000, temperature=1.0, ignore_eos=True, sampling_seed=3)


@dataclass(frozen=True)
class Target:
    kind: str
    url: str
    model_dir: Path


@pytest.fixture(scope="session", params=[
    "builtin",
    pytest.param("vllm", marks=pytest.mark.vllm),
    pytest.param("sglang", marks=pytest.mark.sglang),
])
def target(request, tiny_model_dir) -> Target:
    model_dir = tiny_model_dir
    if request.param == "builtin":
        url = request.getfixturevalue("builtin_engine_url")
    elif request.param == "vllm":
        url = request.getfixturevalue("vllm_engine_url")
    else:
        url = request.config.getoption("--sglang-url")
        model_dir = Path(request.config.getoption("--sglang-model") or tiny_model_dir)
    return Target(kind=request.param, url=url, model_dir=model_dir)


@pytest.fixture
async def engine(target):
    driver = VLLMDriver(target.url) if target.kind == "vllm" else SGLangDriver(target.url)
    yield driver
    await driver.close()


@pytest.fixture(scope="session")
def tokenizer(target) -> Tokenizer:
    return Tokenizer.from_file(str(target.model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def model_config(target) -> dict:
    return json.loads((target.model_dir / "config.json").read_text())


def derive_checkpoint(model_dir: Path, out: Path, seed: int = 1) -> Path:
    """A second checkpoint of `model_dir`'s model: the same files, each floating-point
    weight with Gaussian noise of its own standard deviation added (other outputs, the
    same architecture, vocabulary, names and shapes)."""
    shutil.copytree(model_dir, out)
    generator = torch.Generator().manual_seed(seed)
    for weight_file in sorted(out.glob("*.safetensors")):
        tensors = load_file(weight_file)
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=generator) * tensor.float().std()
                tensors[name] = (tensor.float() + noise).to(tensor.dtype)
        save_file(tensors, weight_file, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def second_checkpoint(request, target, tiny_model_dir, tmp_path_factory) -> Path:
    """The checkpoint the weight tests load: the tiny model of another seed on the tiny
    model, else one derived from the served model (`derive_checkpoint`)."""
    if target.model_dir == tiny_model_dir:
        return request.getfixturevalue("other_tiny_model_dir")
    return derive_checkpoint(target.model_dir, tmp_path_factory.mktemp("models") / "second")


async def require_deterministic(engine: EngineDriver, what: str) -> None:
    """Skips where the engine runs without deterministic inference (SGLang 0.5.23 without
    `--enable-deterministic-inference`: it ignores `sampling_seed` and is not
    batch-invariant), which `what` needs."""
    if await engine.honours_seeds() is False:
        pytest.skip(f"{what} needs deterministic inference, which the engine at {engine.url} "
                    "runs without (/server_info: enable_deterministic_inference false)")


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(PROMPT_TEXT).ids)


def require(engine: EngineDriver, capability: str) -> None:
    if capability not in engine.capabilities:
        pytest.skip(f"{type(engine).__name__} has no {capability!r} (an SGLang-only feature)")


def greedy(max_new_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **extra)


def decoded(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    # A byte-level BPE output may end inside a UTF-8 character; engines differ in whether they
    # show the incomplete bytes, so both sides drop them before comparing.
    return tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


async def test_health_and_model_info(engine):
    assert await engine.health()
    info = await engine.model_info()
    assert info.model_path
    assert isinstance(info.weight_version, str) and info.weight_version
    assert isinstance(await engine.server_info(), dict)


async def test_streaming_and_non_streaming_agree(engine, tokenizer, prompt_ids):
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=greedy(16),
                              return_logprob=True)
    whole = await engine.generate(request)
    chunks = [chunk async for chunk in engine.generate_stream(replace(request, rid="stream"))]
    streamed = result_from_chunks(chunks)
    assert len(chunks) > 1
    assert all(chunk.finish_reason is None for chunk in chunks[:-1])
    assert streamed.output_ids == whole.output_ids
    assert streamed.text == whole.text
    assert streamed.finish_reason == whole.finish_reason
    assert [t for _, t in streamed.output_token_logprobs] == whole.output_ids
    for (a, _), (b, _) in zip(streamed.output_token_logprobs, whole.output_token_logprobs,
                              strict=True):
        assert a == pytest.approx(b, abs=1e-3)
    assert whole.text.rstrip("\ufffd") == decoded(tokenizer, whole.output_ids)
    assert whole.prompt_tokens == streamed.prompt_tokens == len(prompt_ids)
    assert whole.completion_tokens == streamed.completion_tokens == len(whole.output_ids)


async def test_logprobs_have_one_entry_per_output_token(engine, prompt_ids):
    request = GenerateRequest(input_ids=prompt_ids, return_logprob=True,
                              sampling_params=SamplingParams(max_new_tokens=12, sampling_seed=1,
                                                             ignore_eos=True))
    result = await engine.generate(request)
    assert len(result.output_ids) == 12
    assert [token_id for _, token_id in result.output_token_logprobs] == result.output_ids
    assert all(logprob <= 1e-6 for logprob, _ in result.output_token_logprobs)
    without = await engine.generate(replace(request, rid="no-logprobs", return_logprob=False))
    assert without.output_token_logprobs == []
    assert without.output_ids == result.output_ids


async def test_max_new_tokens_ends_with_length(engine, prompt_ids):
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=SamplingParams(
        max_new_tokens=5, ignore_eos=True, sampling_seed=2))
    result = await engine.generate(request)
    assert len(result.output_ids) == result.completion_tokens == 5
    assert result.finish_reason.type == "length"
    assert result.prompt_tokens == len(prompt_ids)


async def test_stop_token_ids_end_with_stop(engine, prompt_ids):
    reference = (await engine.generate(GenerateRequest(
        input_ids=prompt_ids, sampling_params=greedy(16, ignore_eos=True)))).output_ids
    stop_id = reference[3]
    expected = reference[:reference.index(stop_id) + 1]
    result = await engine.generate(GenerateRequest(
        input_ids=prompt_ids, sampling_params=greedy(16, stop_token_ids=(stop_id,))))
    assert result.output_ids == expected
    assert result.finish_reason.type == "stop"
    assert result.finish_reason.matched == stop_id


def _stop_string(text: str) -> str:
    """Two visible ASCII characters from the second half of `text` (the tiny random
    model's greedy text changes with the machine's float rounding: it may be all
    punctuation)."""
    for start in range(len(text) // 2, len(text) - 1):
        candidate = text[start:start + 2]
        if candidate.isascii() and candidate.isprintable() and " " not in candidate:
            return candidate
    raise AssertionError(f"no ASCII stop string in the second half of {text!r}")


async def test_stop_strings_end_with_stop_and_are_trimmed(engine, prompt_ids):
    reference = (await engine.generate(GenerateRequest(
        input_ids=prompt_ids, sampling_params=greedy(24, ignore_eos=True)))).text
    stop = _stop_string(reference)
    result = await engine.generate(GenerateRequest(
        input_ids=prompt_ids, sampling_params=greedy(24, ignore_eos=True, stop=(stop,))))
    assert result.finish_reason.type == "stop"
    assert result.finish_reason.matched == stop
    assert result.text == reference[:reference.index(stop)]


async def test_greedy_is_deterministic(engine, prompt_ids):
    await require_deterministic(engine, "the same greedy output alone and in a batch")
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=greedy(24, ignore_eos=True))
    first = await engine.generate(request)
    together = await asyncio.gather(*(engine.generate(replace(request, rid=f"greedy-{i}"))
                                      for i in range(3)))
    assert all(result.output_ids == first.output_ids for result in together)


async def test_sampling_seed_makes_sampling_reproducible(engine, prompt_ids):
    await require_deterministic(engine, "replaying a sample by its seed")

    def seeded(seed: int, rid: str) -> GenerateRequest:
        return GenerateRequest(input_ids=prompt_ids, rid=rid, sampling_params=SamplingParams(
            max_new_tokens=24, temperature=1.0, ignore_eos=True, sampling_seed=seed))

    first = await engine.generate(seeded(7, "seed-7a"))
    again = await engine.generate(seeded(7, "seed-7b"))
    other = await engine.generate(seeded(8, "seed-8"))
    assert again.output_ids == first.output_ids
    assert other.output_ids != first.output_ids


async def test_abort_mid_stream_returns_the_partial_output(engine, prompt_ids):
    request = GenerateRequest(input_ids=prompt_ids, rid="abort-stream", sampling_params=LONG_RUN)
    chunks = []
    async for chunk in engine.generate_stream(request):
        chunks.append(chunk)
        if len(chunks) == 2:
            await engine.abort(request.rid)
    result = result_from_chunks(chunks)
    assert result.finish_reason.type == "abort"
    assert 2 <= len(result.output_ids) < LONG_RUN.max_new_tokens
    assert result.completion_tokens == len(result.output_ids)


async def test_abort_of_a_non_streaming_request_returns_its_partial_output(engine, prompt_ids):
    request = GenerateRequest(input_ids=prompt_ids, rid="abort-whole", sampling_params=LONG_RUN)
    task = asyncio.create_task(engine.generate(request))
    while not task.done():  # until the engine has the request; unknown rids are ignored
        await engine.abort(request.rid)
        await asyncio.wait([task], timeout=0.2)
    result = task.result()
    assert result.finish_reason.type == "abort"
    assert len(result.output_ids) < LONG_RUN.max_new_tokens
    assert await engine.health()


async def test_bad_input_is_rejected_and_others_keep_serving(engine, target, prompt_ids,
                                                             model_config):
    request = GenerateRequest(input_ids=prompt_ids, rid="bystander",
                              sampling_params=greedy(48, ignore_eos=True))
    reference = await engine.generate(replace(request, rid="reference"))
    context_len = model_config["max_position_embeddings"]
    bad_requests = [
        GenerateRequest(input_ids=()),
        GenerateRequest(input_ids=(prompt_ids[0],) * (context_len + 10)),
        GenerateRequest(input_ids=prompt_ids, sampling_params=SamplingParams(top_p=2.0)),
        GenerateRequest(input_ids=prompt_ids, sampling_params=SamplingParams(temperature=-1.0)),
    ]
    if target.kind != "sglang":  # SGLang 0.5.23 does not check input IDs: one it cannot
        # embed takes the server down (the gateway refuses such IDs before any engine)
        bad_requests.append(GenerateRequest(input_ids=(*prompt_ids,
                                                       model_config["vocab_size"] + 5)))

    async def send_bad_input(first_chunk_seen: asyncio.Event) -> list[EngineRejected]:
        await first_chunk_seen.wait()
        errors = []
        for bad in bad_requests:
            with pytest.raises(EngineRejected) as error:
                await engine.generate(bad)
            errors.append(error.value)
        return errors

    first_chunk_seen = asyncio.Event()
    sender = asyncio.create_task(send_bad_input(first_chunk_seen))
    chunks = []
    try:
        async for chunk in engine.generate_stream(request):
            chunks.append(chunk)
            first_chunk_seen.set()
    finally:
        first_chunk_seen.set()
    errors = await sender
    assert all(error.message.strip() for error in errors)
    assert result_from_chunks(chunks).output_ids == reference.output_ids
    assert await engine.health()


async def test_every_reply_names_its_weight_version(engine, prompt_ids):
    version = (await engine.model_info()).weight_version
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=greedy(4))
    assert (await engine.generate(request)).weight_version == version
    chunks = [chunk async for chunk in engine.generate_stream(replace(request, rid="v-stream"))]
    assert chunks[-1].weight_version == version


async def test_text_prompts_are_tokenized_like_the_tokenizer(engine, tokenizer):
    require(engine, "text_input")
    by_text = await engine.generate(GenerateRequest(text=PROMPT_TEXT, sampling_params=greedy(8)))
    by_ids = await engine.generate(GenerateRequest(
        input_ids=tuple(tokenizer.encode(PROMPT_TEXT).ids), sampling_params=greedy(8)))
    assert by_text.prompt_tokens == by_ids.prompt_tokens
    assert by_text.output_ids == by_ids.output_ids


async def test_cached_tokens_count_prefix_hits_until_the_cache_is_flushed(engine, tokenizer):
    require(engine, "cached_tokens")
    require(engine, "flush_cache")
    long_ids = tuple(tokenizer.encode(LONG_TEXT).ids)
    request = GenerateRequest(input_ids=long_ids, sampling_params=greedy(2))
    await engine.flush_cache()
    cold = await engine.generate(request)
    warm = await engine.generate(replace(request, rid="warm"))
    await engine.flush_cache()
    flushed = await engine.generate(replace(request, rid="flushed"))
    assert cold.cached_tokens == 0
    assert 0 < warm.cached_tokens < len(long_ids)
    assert flushed.cached_tokens == 0
    assert warm.output_ids == cold.output_ids == flushed.output_ids


async def test_pause_with_abort_ends_running_requests(engine, prompt_ids):
    require(engine, "pause_abort")
    request = GenerateRequest(input_ids=prompt_ids, rid="paused-abort", sampling_params=LONG_RUN)
    chunks = []
    try:
        async for chunk in engine.generate_stream(request):
            chunks.append(chunk)
            if len(chunks) == 2:
                await engine.pause("abort")
    finally:
        await engine.resume()
    assert result_from_chunks(chunks).finish_reason.type == "abort"
    after = await engine.generate(GenerateRequest(input_ids=prompt_ids,
                                                  sampling_params=greedy(4, ignore_eos=True)))
    assert after.finish_reason.type == "length" and len(after.output_ids) == 4


async def test_pause_in_place_keeps_running_requests(engine, prompt_ids):
    require(engine, "pause_in_place")
    request = GenerateRequest(input_ids=prompt_ids, rid="paused-in-place",
                              sampling_params=greedy(48, ignore_eos=True))
    reference = await engine.generate(replace(request, rid="in-place-reference"))
    chunks = []
    two_chunks = asyncio.Event()

    async def consume() -> None:
        try:
            async for chunk in engine.generate_stream(request):
                chunks.append(chunk)
                if len(chunks) == 2:
                    two_chunks.set()
        finally:
            two_chunks.set()

    consumer = asyncio.create_task(consume())
    try:
        await two_chunks.wait()
        await engine.pause("in_place")
        num_chunks_at_pause = len(chunks)
        await asyncio.sleep(1.0)
        num_chunks_while_paused = len(chunks) - num_chunks_at_pause
    finally:
        await engine.resume()
    await consumer
    result = result_from_chunks(chunks)
    assert result.finish_reason.type == "length"
    assert result.output_ids == reference.output_ids
    assert num_chunks_while_paused <= 2  # at most what was already on its way


async def test_update_weights_from_disk_changes_outputs_and_version(engine, prompt_ids,
                                                                   second_checkpoint):
    require(engine, "update_weights_from_disk")
    before = await engine.model_info()
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=greedy(12, ignore_eos=True))
    old = await engine.generate(request)
    try:
        await engine.update_weights_from_disk(str(second_checkpoint), "conformance-1")
        new = await engine.generate(replace(request, rid="new-weights"))
        assert (await engine.model_info()).weight_version == "conformance-1"
    finally:
        await engine.update_weights_from_disk(before.model_path, before.weight_version)
    restored = await engine.generate(replace(request, rid="restored-weights"))
    assert new.weight_version == "conformance-1"
    assert new.output_ids != old.output_ids
    assert restored.output_ids == old.output_ids
    assert restored.weight_version == before.weight_version


async def test_requests_without_a_seed_sample_distinct_completions(engine, prompt_ids):
    """A GRPO group: one prompt, eight samples. SGLang 0.5.23 in deterministic mode gives
    every request without a seed the seed 42 (issue #20): the driver must send seeds."""
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=SamplingParams(
        max_new_tokens=16, temperature=1.0, ignore_eos=True))
    results = await asyncio.gather(*(engine.generate(replace(request, rid=f"group-{i}"))
                                     for i in range(8)))
    assert len({tuple(result.output_ids) for result in results}) == 8


async def test_a_weight_update_during_an_in_place_pause_completes_and_keeps_the_pause(
        engine, prompt_ids, second_checkpoint):
    """The update reports the new version, and the engine stays paused until `resume`
    (SGLang 0.5.23 refuses the cache flush while a request is held in place; vLLM's reload
    pause would end the caller's pause)."""
    require(engine, "pause_in_place")
    require(engine, "update_weights_from_disk")
    before = await engine.model_info()
    held = GenerateRequest(input_ids=prompt_ids, rid="held-in-place",
                           sampling_params=greedy(48, ignore_eos=True))
    chunks = []
    two_chunks = asyncio.Event()

    async def consume() -> None:
        try:
            async for chunk in engine.generate_stream(held):
                chunks.append(chunk)
                if len(chunks) == 2:
                    two_chunks.set()
        finally:
            two_chunks.set()

    consumer = asyncio.create_task(consume())
    queued = None
    try:
        await two_chunks.wait()
        await engine.pause("in_place")
        await engine.update_weights_from_disk(str(second_checkpoint), "conformance-2")
        version = (await engine.model_info()).weight_version
        queued = asyncio.create_task(engine.generate(GenerateRequest(
            input_ids=prompt_ids, rid="queued-while-paused",
            sampling_params=greedy(4, ignore_eos=True))))
        await asyncio.sleep(1.0)
        answered_while_paused = queued.done()
    finally:
        await engine.resume()
        await consumer
        after = await queued if queued is not None else None
        await engine.update_weights_from_disk(before.model_path, before.weight_version)
    assert version == "conformance-2"
    assert not answered_while_paused
    assert result_from_chunks(chunks).finish_reason.type == "length"
    assert after.weight_version == "conformance-2"
