"""Tree attention by flex_attention (`attention.flex_block_mask`), against dense masked
attention.

- The BlockMask's mask function, evaluated at every (query, key), is the micro-batch's
  ancestor-only mask (`MicroBatch.allowed`), for every micro-batch of two branching
  groups packed at 30 tokens (so several micro-batches hold repeated context).
- On a CPU (forward only: torch 2.13 has no flex_attention backward there, and runs it
  eagerly, which is the check's point): every term's logprob and entropy through
  `score(attention="flex")` equals the dense (1, 1, T, T) mask's within 1e-5.
- On CUDA (`gpu`): the step's gradient by flex equals the dense one within 1e-4 of each
  parameter's scale (float32), the compiled kernel included.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from undertow.learner.advantages import group_advantages
from undertow.learner.attention import flex_block_mask
from undertow.learner.config import AdvantageConfig, LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.sharding import step_to

EAGER_WARNING = "ignore:.*flex_attention.*:UserWarning"


def _step(random_trees, max_tokens=30):
    advantages = {(tree.group_id, s): a for tree in random_trees
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    return pack_step(random_trees, advantages, max_tokens)


def test_the_block_mask_is_the_ancestor_only_mask(random_trees):
    step = _step(random_trees)
    assert len(step.micro_batches) > 2
    for micro_batch in step.micro_batches:
        block_mask = flex_block_mask(micro_batch, block_size=16)
        num_tokens = micro_batch.num_tokens
        dense = create_mask(block_mask.mask_mod, None, None, num_tokens, num_tokens,
                            device="cpu")[0, 0]
        assert torch.equal(dense, micro_batch.allowed())
        assert not dense.tril().all()   # a branch: some earlier token is not an ancestor


@pytest.mark.filterwarnings(EAGER_WARNING)
def test_flex_scores_equal_dense_scores_on_cpu(random_trees, policy32):
    step = _step(random_trees)
    with torch.no_grad():
        for micro_batch in step.micro_batches:
            flex = policy32.score(micro_batch, with_entropy=True, attention="flex")
            dense = policy32.score(micro_batch, with_entropy=True, attention="dense")
            assert torch.allclose(flex.logprobs, dense.logprobs, rtol=0, atol=1e-5)
            assert torch.allclose(flex.entropy, dense.entropy, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_flex_gradient_equals_dense_gradient_on_cuda(random_trees, tiny_model_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda")
    policy = PolicyModel.load(tiny_model_dir)
    policy.model.to(device).train()
    step = step_to(_step(random_trees, max_tokens=200), device)
    config = LossConfig(name="grpo", entropy_coef=0.01)
    gradients = {}
    for attention in ("flex", "dense"):
        policy.attention = attention
        policy.model.zero_grad(set_to_none=True)
        backward_step(policy, step, config)
        gradients[attention] = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    for name, dense in gradients["dense"].items():
        scale = dense.abs().max()
        assert scale > 0
        assert (gradients["flex"][name] - dense).abs().max() <= 1e-4 * scale, name
