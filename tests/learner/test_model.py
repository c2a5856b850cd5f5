"""The packed forward honours the ancestor-only mask (dense 4-D, or block attention)
and original positions: scores from one packed micro-batch equal scores from each
path run alone."""

import pytest
import torch

from tests.learner.random_trees import build_random_tree
from undertow.learner.model import PolicyModel
from undertow.learner.packing import pack_step
from undertow.learner.reference import flat_samples


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
        packed = dict(zip(step.micro_batches[0].term_ids.tolist(),
                          zip(scores.logprobs.tolist(), scores.entropy.tolist(), strict=True),
                          strict=True))
        by_behaviour = {float(step.behaviour_logprobs[t]): v for t, v in packed.items()}
        num_checked = 0
        for sample in flat_samples([tree], advantages):
            path = policy.score_path(sample.token_ids, sample.scored, with_entropy=True)
            for behaviour, logprob, entropy in zip(sample.behaviour.tolist(),
                                                   path.logprobs.tolist(),
                                                   path.entropy.tolist(), strict=True):
                assert by_behaviour[behaviour] == pytest.approx((logprob, entropy), abs=1e-5)
                num_checked += 1
    assert num_checked == step.num_terms


def test_blocks_cover_the_sequence_and_reach_only_ancestors():
    from undertow.learner.model import attention_blocks

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
