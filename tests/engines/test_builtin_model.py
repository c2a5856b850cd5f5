"""The built-in Qwen3 forward and sampler, checked against transformers on the tiny model."""

import random

import pytest
import torch

from undertow.gateway.engines.builtin.model import ModelConfig, Qwen3, SlotKV, load_weights
from undertow.gateway.engines.builtin.sampling import SamplingParams, sample


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    config = ModelConfig.from_dir(tiny_model_dir)
    ours = Qwen3(config, load_weights(tiny_model_dir, config))
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
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, sampling_seed=7),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, min_p=0.05, sampling_seed=8),
              SamplingParams(temperature=1.3, sampling_seed=9)]

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
    params = [SamplingParams(temperature=1.0, top_k=3)]
    generator = torch.Generator().manual_seed(0)
    picks = {sample(logits, params, [generator], 0).token_ids[0] for _ in range(200)}
    assert picks <= {97, 98, 99}
    assert len(picks) > 1
