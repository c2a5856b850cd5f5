"""The built-in forward and sampler, checked against transformers on the tiny model;
the device path (`device`, `dtype`): auto is the CPU here, bfloat16 runs on it."""

import random

import pytest
import torch
from safetensors.torch import load

from undertow.gateway.builtin_engine.model import CausalLM, ModelConfig, SlotKV, load_weights
from undertow.gateway.builtin_engine.sampling import RequestSampling, sample


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    config = ModelConfig.from_dir(tiny_model_dir)
    ours = CausalLM(config, load_weights(tiny_model_dir, config))
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ours, theirs


def reference_logprobs(theirs, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(theirs(torch.tensor([token_ids])).logits[0], -1)


def test_prefill_then_decode_matches_transformers(models):
    ours, theirs = models
    token_ids = random.Random(0).choices(range(3, ours.config.vocab_size), k=48)
    reference = reference_logprobs(theirs, token_ids)
    kv = SlotKV(ours.config)
    kv.reserve(1, len(token_ids))
    first = torch.log_softmax(ours.prefill(kv, 0, token_ids[:20], 0, slice(None)), -1)
    second = torch.log_softmax(ours.prefill(kv, 0, token_ids[20:40], 20, slice(None)), -1)
    assert torch.allclose(first, reference[:20], atol=1e-4)
    assert torch.allclose(second, reference[20:40], atol=1e-4)
    for position in range(40, 48):
        step = torch.log_softmax(ours.decode(kv, [token_ids[position]], [position]), -1)
        assert torch.allclose(step[0], reference[position], atol=1e-4)


def test_batched_decode_gives_each_row_its_solo_result(models):
    ours, _ = models
    rng = random.Random(1)
    prompts = [rng.choices(range(3, ours.config.vocab_size), k=rng.randint(5, 40))
               for _ in range(6)]
    kv = SlotKV(ours.config)
    kv.reserve(len(prompts), 64)
    solo = []
    for prompt in prompts:
        ours.prefill(kv, 0, prompt[:-1], 0, slice(-1, None))
        solo.append(ours.decode(kv, [prompt[-1]], [len(prompt) - 1])[0])
    for slot, prompt in enumerate(prompts):
        ours.prefill(kv, slot, prompt[:-1], 0, slice(-1, None))
    batched = ours.decode(kv, [p[-1] for p in prompts], [len(p) - 1 for p in prompts])
    for row, expected in zip(batched, solo, strict=True):
        assert torch.allclose(row, expected, atol=1e-5)
        assert row.argmax() == expected.argmax()


def test_seeded_sampling_does_not_depend_on_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [RequestSampling(temperature=1.0, top_p=0.9, top_k=20, sampling_seed=7),
              RequestSampling(temperature=0.0),
              RequestSampling(temperature=0.7, min_p=0.05, sampling_seed=8),
              RequestSampling(temperature=1.3, sampling_seed=9)]

    def generators():
        return [torch.Generator().manual_seed(p.sampling_seed or 0) for p in params]

    batch = generators()
    together = [sample(logits, params, batch, 0).token_ids for _ in range(5)]
    alone = []
    single = generators()
    for _ in range(5):
        alone.append([sample(logits[i:i + 1], [p], [single[i]], 0).token_ids[0]
                      for i, p in enumerate(params)])
    assert together == alone
    assert all(step[1] == int(logits[1].argmax()) for step in together)


def test_sampling_respects_top_k():
    logits = torch.arange(100.0).unsqueeze(0) / 50
    params = [RequestSampling(temperature=1.0, top_k=3)]
    generator = torch.Generator().manual_seed(0)
    picks = {sample(logits, params, [generator], 0).token_ids[0] for _ in range(200)}
    assert picks <= {97, 98, 99}
    assert len(picks) > 1


def test_auto_is_the_cpu_here_and_cuda_says_what_to_do():
    from undertow.gateway.builtin_engine.errors import WeightLoadError
    from undertow.gateway.builtin_engine.model import resolve_device, resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: 'auto' is CUDA")
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(WeightLoadError, match="device=auto"):
        resolve_device("cuda")


def test_bfloat16_weights_and_kv_on_the_device_track_float32(models, tiny_model_dir):
    """The device path (weights, KV, index tensors and masks on `device`, in its dtype)
    run on the CPU in bfloat16: logits come back as float32 on the CPU and stay within
    bfloat16's error of the float32 model's, prefill and batched decode."""
    ours, _ = models
    config = ours.config
    low = CausalLM(config, load_weights(tiny_model_dir, config, torch.device("cpu"),
                                        torch.bfloat16))
    assert (low.device, low.dtype) == (torch.device("cpu"), torch.bfloat16)
    rng = random.Random(2)
    prompts = [rng.choices(range(3, config.vocab_size), k=rng.randint(5, 30)) for _ in range(3)]
    results = []
    for model in (ours, low):
        kv = SlotKV(config, model.device, model.dtype)
        kv.reserve(len(prompts), 64)
        first = [model.prefill(kv, slot, p[:-1], 0, slice(None)) for slot, p in enumerate(prompts)]
        step = model.decode(kv, [p[-1] for p in prompts], [len(p) - 1 for p in prompts])
        assert kv.k.dtype == model.dtype
        results.append([torch.log_softmax(t, -1) for t in (*first, step)])
    for full, half in zip(*results, strict=True):
        assert half.dtype == torch.float32 and half.device.type == "cpu"
        assert not torch.equal(full, half)   # bf16 did run
        assert (full - half).abs().max() < 0.1
        assert (full - half).abs().mean() < 0.01


async def test_a_bfloat16_engine_serves_and_moves_its_kv_as_float32(tiny_model_dir, start_engine):
    """`engine serve device=auto dtype=bfloat16`: auto resolves to the CPU here; the
    engine generates, exports a finished sequence's KV as float32 and imports it back (after
    a cache flush) so that the sequence continues as it did (bf16 -> f32 -> bf16 is exact)."""
    import aiohttp

    from tests.builtin_engine.wire import generate, get, post, prompt
    from undertow.gateway.engines.sglang import SGLangDriver

    ids, sampling = prompt(4, 60), {"temperature": 0.0, "ignore_eos": True}
    with start_engine(tiny_model_dir, "device=auto", "dtype=bfloat16") as url:
        async with aiohttp.ClientSession() as session, SGLangDriver(url) as driver:
            info = await get(session, url, "/get_server_info")
            expected = await generate(session, url, input_ids=ids, return_logprob=True,
                                      sampling_params={**sampling, "max_new_tokens": 12})
            head = expected["output_ids"][:6]
            payload = await driver.export_kv(input_ids=ids + head)
            assert (await post(session, url, "/flush_cache"))[0] == 200
            assert await driver.import_kv(payload) == len(ids) + 6
            tail = await generate(session, url, input_ids=ids + head,
                                  sampling_params={**sampling, "max_new_tokens": 6})
    assert (info["device"], info["dtype"]) == ("cpu", "bfloat16")
    assert all(entry[0] <= 0 for entry in expected["meta_info"]["output_token_logprobs"])
    kv = load(payload.data)["kv"]
    assert kv.dtype == torch.float32 and kv.shape[3] == len(ids) + 6
    assert tail["meta_info"]["cached_tokens"] == len(ids) + 5
    assert head + tail["output_ids"] == expected["output_ids"]
