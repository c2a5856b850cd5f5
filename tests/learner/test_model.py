"""The packed forward honours the ancestor-only mask (dense 4-D, or block attention)
and original positions: scores from one packed micro-batch equal scores from each
path run alone."""

import pytest
import torch

from tests.learner.path_scores import assert_scores_equal_per_path
from tests.learner.random_trees import build_random_tree
from undertow.learner.model import PolicyModel
from undertow.learner.packing import pack_step


@pytest.mark.parametrize(("attn_implementation", "attention", "max_query_tokens"), [
    ("eager", "dense", 0), ("sdpa", "dense", 0), ("undertow_tree", "dense", 0),
    ("undertow_tree", "blocks", 1024), ("undertow_tree", "blocks", 3)])
def test_packed_scores_equal_per_path_scores(tiny_model_dir, attn_implementation, attention,
                                             max_query_tokens):
    policy = PolicyModel.load(tiny_model_dir, attn_implementation=attn_implementation)
    policy.max_query_tokens = max_query_tokens
    tree = build_random_tree(3, num_sessions=3, num_turns=3)
    advantages = {(tree.group_id, s): 1.0 for s in tree.sessions}
    step = pack_step([tree], advantages, 10**6)
    with torch.no_grad():
        scores = policy.score(step.micro_batches[0], with_entropy=True, attention=attention)
    assert_scores_equal_per_path(step, scores, [tree], advantages, policy)


def test_blocks_cover_the_sequence_and_reach_only_ancestors():
    from undertow.learner.attention import attention_blocks

    tree = build_random_tree(4, num_sessions=3, num_turns=4)
    step = pack_step([tree], {(tree.group_id, s): 1.0 for s in tree.sessions}, 10**6)
    micro_batch = step.micro_batches[0]
    allowed = micro_batch.allowed()
    blocks = attention_blocks(micro_batch, max_query_tokens=5)
    assert [c[0] for c in blocks.chunks] == [0] + [c[1] for c in blocks.chunks[:-1]]
    assert blocks.chunks[-1][1] == micro_batch.num_tokens
    for start, end, ranges in blocks.chunks:
        keys = [j for a, b in ranges for j in range(a, b)]
        for row, i in enumerate(range(start, end)):
            # Lower-right causal: query row r sees the first len(keys) - (end - start) + r + 1.
            seen = set(keys[:len(keys) - (end - start) + row + 1])
            assert seen == set(allowed[i].nonzero().flatten().tolist())


def test_merged_block_attention_equals_masked_softmax_attention_and_its_gradients():
    """The CPU block attention (parts merged by log-sum-exp, flash backward per part)
    against plain softmax attention under the same ancestor mask, float64."""
    from undertow.learner.attention import AttentionBlocks, _MergedBlockAttention

    generator = torch.Generator().manual_seed(3)
    num_tokens, scale = 23, 0.3
    query, key, value = (torch.randn(1, heads, num_tokens, 8, generator=generator,
                                     dtype=torch.float64, requires_grad=True)
                         for heads in (4, 2, 2))
    # A root chain [0, 9), a child chain [9, 16) under [0, 9), and a chain [16, 23)
    # under [0, 4): the last one's ancestors leave a gap.
    blocks = AttentionBlocks([(0, 4, [(0, 4)]), (4, 9, [(0, 9)]), (9, 12, [(0, 12)]),
                              (12, 16, [(0, 16)]), (16, 20, [(0, 4), (16, 20)]),
                              (20, 23, [(0, 4), (16, 23)])])
    allowed = torch.zeros(num_tokens, num_tokens, dtype=torch.bool)
    for start, end, ranges in blocks.chunks:
        keys = torch.tensor([j for a, b in ranges for j in range(a, b)])
        for row, i in enumerate(range(start, end)):
            allowed[i, keys[:len(keys) - (end - start) + row + 1]] = True
    upstream = torch.randn(1, 4, num_tokens, 8, generator=generator, dtype=torch.float64)

    merged = _MergedBlockAttention.apply(query, key, value, blocks, scale)
    merged_grads = torch.autograd.grad((merged * upstream).sum(), (query, key, value))
    wide_key, wide_value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    scores = (query @ wide_key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    plain = scores.softmax(-1) @ wide_value
    plain_grads = torch.autograd.grad((plain * upstream).sum(), (query, key, value))

    torch.testing.assert_close(merged, plain, rtol=1e-10, atol=1e-10)
    for got, expected in zip(merged_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
