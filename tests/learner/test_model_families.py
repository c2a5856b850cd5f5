"""The learner on the pretrained families, not only the tiny Qwen3: Llama (SmolLM2) and
Qwen2 (Qwen2.5-Coder, q/k/v biases), both with the head tied to the embedding.

- The architectures, shrunk to 2 layers of width 64 from the real configs (`conftest.py`):
  packed scores equal one forward per path with every mask (dense, blocks); the tree
  step's loss and every gradient equal the flat per-session reference, whole and in
  segments with activation checkpointing and the LM head in chunks.
- SmolLM2's real weights (float32) on sessions rendered by its real chat template and
  tokenized by its real tokenizer (`chat_trees.py`): the tree step's loss and every
  gradient equal the flat per-session reference (`reference.py`), whole and with the
  micro-batch scored in segments.
- A model with sliding-window layers is refused by tree attention, with what to do.
"""

import pytest
import torch

from tests.learner.chat_trees import build_chat_tree
from tests.learner.path_scores import assert_scores_equal_per_path
from tests.learner.random_trees import build_random_tree
from undertow.learner.config import LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.reference import flat_loss, flat_samples

FAMILIES = ["tiny_llama_model_dir", "tiny_qwen2_model_dir"]
# Relative to each sum's scale, as tests/learner/test_losses.py measures it. SmolLM2's
# 30 float32 layers: the tree's gradients differ from the flat ones by up to 2e-4 of a
# gradient's largest entry (a k_proj's), its loss by 1e-6; rounding, not the tree: in
# float64 (4 layers) the tree and the flat sums agree to 6e-7, as closely as two flat
# orders do (one sample per session, one per call), the floor of Llama's RMSNorm, which
# computes in float32 whatever the model's dtype.
RTOL = 1e-5
REAL_RTOL = 1e-3
CONFIG = LossConfig(name="grpo", correction="tis", entropy_coef=0.01, max_importance_weight=2.0)


def _advantages(trees):
    return {(t.group_id, s): (-1.0) ** i * (i + 1) / 3
            for t in trees for i, s in enumerate(t.sessions)}


def _gradients(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_gradients_close(got, expected, rtol=RTOL):
    for name, reference in expected.items():
        scale = reference.abs().max()
        assert scale > 0, f"{name}: zero gradient, the comparison would be vacuous"
        error = (got[name] - reference).abs().max()
        assert error <= rtol * scale, f"{name}: {error:.3g} vs scale {scale:.3g}"


def _assert_tree_step_equals_flat(model, trees, rtol=RTOL, **options) -> dict:
    """The flat per-session loss and gradients, then the packed step's with `options`
    (PolicyModel's); returns the step's stats."""
    advantages = _advantages(trees)
    model.zero_grad(set_to_none=True)
    flat_policy = PolicyModel(model, head_chunk_tokens=0, max_segment_tokens=0)
    flat = flat_loss(flat_policy, flat_samples(trees, advantages), CONFIG)
    flat_grads = _gradients(model)
    step = pack_step(trees, advantages, 10**6)
    stats = backward_step(PolicyModel(model, **options), step, CONFIG)
    assert abs(stats["loss"] - flat) <= rtol * stats["loss_abs_sum"]
    assert stats["num_terms"] == step.num_terms
    _assert_gradients_close(_gradients(model), flat_grads, rtol)
    return stats


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["dense", "blocks"])
def test_packed_scores_equal_per_path_scores(family, attention, request):
    policy = PolicyModel.load(request.getfixturevalue(family), max_query_tokens=4)
    assert policy.model.get_output_embeddings().weight is policy.model.get_input_embeddings(
    ).weight
    tree = build_random_tree(3, num_sessions=3, num_turns=3)
    advantages = {(tree.group_id, s): 1.0 for s in tree.sessions}
    step = pack_step([tree], advantages, 10**6)
    with torch.no_grad():
        scores = policy.score(step.micro_batches[0], with_entropy=True, attention=attention)
    assert_scores_equal_per_path(step, scores, [tree], advantages, policy)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("options", [
    {"max_query_tokens": 5},
    {"max_query_tokens": 5, "head_chunk_tokens": 4, "max_segment_tokens": 9,
     "activation_checkpointing": True},
], ids=["whole", "segments-ckpt"])
def test_tree_step_equals_the_flat_reference(family, options, request, random_trees):
    model = PolicyModel.load(request.getfixturevalue(family)).model
    model.train()
    if options.get("max_segment_tokens"):
        step = pack_step(random_trees, _advantages(random_trees), 10**6)
        assert all(mb.num_tokens > 9 for mb in step.micro_batches)
    _assert_tree_step_equals_flat(model, random_trees, **options)


@pytest.fixture(scope="module")
def smollm2_model(smollm2_dir):
    """SmolLM2-135M-Instruct's real weights in float32, in training mode."""
    model = PolicyModel.load(smollm2_dir, dtype=torch.float32).model
    model.train()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {},
    {"max_segment_tokens": 64, "head_chunk_tokens": 32, "max_query_tokens": 48},
], ids=["whole", "segments"])
def test_smollm2_tree_step_on_its_chat_template_equals_the_flat_reference(
        smollm2_dir, smollm2_model, options):
    tree = build_chat_tree(smollm2_dir)
    assert len(tree.sessions["s2"].leaves) == 2          # the condensed session branches
    assert tree.num_flat_tokens > 2 * tree.num_unique_tokens
    step = pack_step([tree], _advantages([tree]), 10**6)
    (micro_batch,) = step.micro_batches
    if options:
        assert micro_batch.num_tokens > 2 * options["max_segment_tokens"]
    stats = _assert_tree_step_equals_flat(smollm2_model, [tree], REAL_RTOL, **options)
    assert stats["num_terms"] > 50


def test_sliding_window_layers_are_refused_by_tree_attention(tiny_qwen2_model_dir, tmp_path):
    import json
    import shutil

    shutil.copytree(tiny_qwen2_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=0,
                  layer_types=["sliding_attention", "sliding_attention"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"sliding_attention.*attn_implementation='sdpa'"):
        PolicyModel.load(tmp_path / "m")
    dense = PolicyModel.load(tmp_path / "m", attn_implementation="sdpa")
    with pytest.raises(ValueError, match="needs the model loaded with"):
        dense.resolve_attention("blocks")
    assert dense.resolve_attention() == "dense"

