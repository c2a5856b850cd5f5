"""Each family the built-in forward runs (`model_config.py`), on a small random model that
transformers builds and saves: its prefill (whole and chunked after a prefix) and a batched
decode of rows of different lengths give transformers' logits. The configs cover every
branch: q/k norm or none, q/k/v(/o) biases, MLP biases, tied and untied heads, Llama 3.x
rope scaling, GQA and MHA, an explicit head_dim. Configurations the forward cannot run are
refused by the field that asks for them."""

import json
import random

import pytest
import torch

from undertow.gateway.builtin_engine.errors import WeightLoadError
from undertow.gateway.builtin_engine.model import CausalLM, SlotKV, load_weights
from undertow.gateway.builtin_engine.model_config import ModelConfig, RopeConfig

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
FAMILIES = {
    "llama": ("llama", dict(tie_word_embeddings=True)),
    "llama3 scaled, untied, biases": ("llama", dict(
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True, head_dim=16,
        rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2 untied, mha": ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "qwen3 with attention bias": ("qwen3", dict(tie_word_embeddings=False,
                                                attention_bias=True, head_dim=8)),
}


def save_random_model(model_type: str, overrides: dict, path, seed: int = 0):
    """A transformers model of the family with every parameter random (biases and norm
    gains too, which transformers initialises to 0 and 1), saved to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn_like(parameter)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    model_type, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp("family")
    theirs = save_random_model(model_type, overrides, path)
    config = ModelConfig.from_dir(path)
    return CausalLM(config, load_weights(path, config)), theirs


def reference_logits(theirs, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return theirs(torch.tensor([token_ids])).logits[0]


def test_the_config_says_what_the_family_has(family):
    ours, theirs = family
    c, hf = ours.config, theirs.config
    assert c.qk_norm == (hf.model_type == "qwen3")
    assert c.qkv_bias == (hf.model_type == "qwen2" or bool(hf.attention_bias))
    assert c.o_bias == (hf.model_type != "qwen2" and bool(hf.attention_bias))
    assert c.mlp_bias == bool(getattr(hf, "mlp_bias", False))
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    head = ours.weights.lm_head  # packed for oneDNN on the CPU (a tied one apart from embed)
    head = head.to_dense() if head.is_mkldnn else head
    assert torch.equal(head, ours.weights.embed) == hf.tie_word_embeddings


def test_prefill_whole_and_chunked_match_transformers(family):
    ours, theirs = family
    token_ids = random.Random(0).choices(range(ours.config.vocab_size), k=100)
    reference = reference_logits(theirs, token_ids)
    kv = SlotKV(ours.config)
    kv.reserve(1, len(token_ids))
    whole = ours.prefill(kv, 0, token_ids, 0, slice(None))
    head = ours.prefill(kv, 0, token_ids[:37], 0, slice(None))
    tail = ours.prefill(kv, 0, token_ids[37:], 37, slice(None))
    assert (whole - reference).abs().max() < 1e-4
    assert (torch.cat([head, tail]) - reference).abs().max() < 1e-4


def test_batched_decode_of_rows_of_different_lengths_matches_transformers(family):
    ours, theirs = family
    rng = random.Random(1)
    rows = [rng.choices(range(ours.config.vocab_size), k=length) for length in (9, 70, 31)]
    num_steps = 4
    kv = SlotKV(ours.config)
    kv.reserve(len(rows), 128)
    prompts = [row[:-num_steps] for row in rows]
    for slot, prompt in enumerate(prompts):
        ours.prefill(kv, slot, prompt, 0, slice(-1, None))
    references = [reference_logits(theirs, row) for row in rows]
    for step in range(num_steps):
        positions = [len(prompt) + step for prompt in prompts]
        logits = ours.decode(kv, [row[p] for row, p in zip(rows, positions, strict=True)],
                             positions)
        for row_logits, reference, position in zip(logits, references, positions, strict=True):
            assert (row_logits - reference[position]).abs().max() < 1e-4


def test_llama3_frequencies_are_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**{**SHAPE, "head_dim": 16}, rope_parameters=LLAMA3_ROPE)
    expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](hf)
    rope = ModelConfig.from_json(hf.to_dict(), "config.json").rope
    ours = torch.tensor(rope.frequencies(16), dtype=torch.float32)
    assert scaling == 1.0
    assert torch.allclose(ours, expected, rtol=1e-6)
    assert not torch.allclose(ours, torch.tensor(RopeConfig(1e4).frequencies(16)), rtol=1e-3)


def test_the_older_rope_fields_read_as_the_newer():
    newer = {"model_type": "llama", **SHAPE, "rope_parameters": LLAMA3_ROPE}
    older = {"model_type": "llama", **SHAPE, "rope_theta": LLAMA3_ROPE["rope_theta"],
             "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}
    assert ModelConfig.from_json(newer, "new").rope == ModelConfig.from_json(older, "old").rope
    assert ModelConfig.from_json(newer, "new").rope.kind == "llama3"


REFUSED = {
    "model_type": {"model_type": "mixtral"},
    "use_sliding_window": {"model_type": "qwen2", "use_sliding_window": True},
    "layer_types": {"model_type": "qwen3", "layer_types": ["full_attention",
                                                           "sliding_attention"]},
    "num_experts": {"model_type": "qwen3", "num_experts": 8},
    "rope_type": {"model_type": "llama", "rope_parameters": {"rope_type": "yarn",
                                                              "rope_theta": 1e4}},
    "partial_rotary_factor": {"model_type": "llama", "partial_rotary_factor": 0.5},
    "hidden_act": {"model_type": "llama", "hidden_act": "gelu"},
    "original_max_position_embeddings": {"model_type": "llama", "rope_parameters": {
        k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_what_the_forward_cannot_run_is_refused_by_its_field(tmp_path, field):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **REFUSED[field]}))
    with pytest.raises(WeightLoadError, match=field):
        ModelConfig.from_dir(tmp_path)
