"""Bounded-memory scoring is exact: the LM head in chunks of positions (`lm_head.py`) and
a long micro-batch in segments reusing earlier keys and values (`segments.py`), with
and without activation checkpointing, against the unchunked head and the flat
per-path reference, forward and every gradient."""

import copy

import pytest
import torch

from tests.learner.path_scores import assert_scores_equal_per_path
from tests.learner.random_trees import build_random_tree
from undertow.learner.attention import attention_blocks, split_blocks
from undertow.learner.config import LossConfig
from undertow.learner.lm_head import ScoringHead, chunked_scores, head_scores
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.reference import flat_loss, flat_samples

RTOL = 1e-5


def _head_case(dtype):
    generator = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(8, 50, bias=True).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 8, generator=generator, dtype=dtype))
        head.bias.copy_(torch.randn(50, generator=generator, dtype=dtype))
    hidden = torch.randn(13, 8, generator=generator, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=generator)
    upstream = [torch.randn(13, generator=generator, dtype=dtype) for _ in range(2)]
    return head, hidden, targets, upstream


def _head_run(score, dtype, with_entropy=True):
    head, hidden, targets, (up_logprobs, up_entropy) = _head_case(dtype)
    logprobs, entropy = score(head, hidden, targets, with_entropy)
    loss = (logprobs * up_logprobs).sum()
    if with_entropy:
        loss = loss + (entropy * up_entropy).sum()
    inputs = (hidden, head.weight, head.bias)
    return (logprobs, entropy), torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 13, 100])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_head_equals_the_full_head_and_its_gradients(chunk_tokens, with_entropy):
    (full, full_entropy), full_grads = _head_run(head_scores, torch.float64, with_entropy)
    (chunked, chunked_entropy), chunked_grads = _head_run(
        lambda *a: chunked_scores(*a, chunk_tokens=chunk_tokens), torch.float64, with_entropy)
    torch.testing.assert_close(chunked, full, rtol=1e-12, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(chunked_entropy, full_entropy, rtol=1e-12, atol=1e-12)
    else:
        assert chunked_entropy is None and full_entropy is None
    for got, expected in zip(chunked_grads, full_grads, strict=True):
        assert expected.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_tokens", [0, 4])
def test_a_scoring_head_scores_through_its_forward_as_the_linear_head(chunk_tokens):
    """The head a sharded model's own LM head becomes: same parameters (by name), same
    scores and gradients; its forward runs (where FSDP2 gathers a unit's weight)."""
    (full, full_entropy), full_grads = _head_run(head_scores, torch.float64)
    calls = []

    def through_scoring_head(head, *args):
        scoring = ScoringHead(head)
        assert [n for n, _ in scoring.named_parameters()] == ["weight", "bias"]
        assert scoring.weight is head.weight
        scoring.register_forward_hook(lambda *_: calls.append(chunk_tokens))
        if chunk_tokens:
            return chunked_scores(scoring, *args, chunk_tokens=chunk_tokens)
        return head_scores(scoring, *args)

    (scored, entropy), grads = _head_run(through_scoring_head, torch.float64)
    assert calls == [chunk_tokens]
    torch.testing.assert_close(scored, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, full_entropy, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_chunked_head_in_bfloat16_softmaxes_in_float32_like_the_full_head():
    (full, full_entropy), full_grads = _head_run(head_scores, torch.bfloat16)
    (chunked, chunked_entropy), chunked_grads = _head_run(
        lambda *a: chunked_scores(*a, chunk_tokens=4), torch.bfloat16)
    assert chunked.dtype == full.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_entropy, full_entropy, rtol=1e-5, atol=1e-5)
    for got, expected in zip(chunked_grads, full_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)   # bf16 grads


def test_split_blocks_keep_each_query_on_its_ancestors():
    tree = build_random_tree(4, num_sessions=3, num_turns=4)
    micro_batch = pack_step([tree], {(tree.group_id, s): 1.0 for s in tree.sessions},
                            10**6).micro_batches[0]
    allowed = micro_batch.allowed()
    num_tokens = micro_batch.num_tokens
    bounds = [(s, min(s + 7, num_tokens)) for s in range(0, num_tokens, 7)]
    segments = split_blocks(attention_blocks(micro_batch, max_query_tokens=5), bounds)
    rows_seen = 0
    for (start, end), blocks in zip(bounds, segments, strict=True):
        assert blocks.query_offset == start
        assert blocks.chunks[0][0] == start and blocks.chunks[-1][1] == end
        for chunk_start, chunk_end, ranges in blocks.chunks:
            keys = [j for a, b in ranges for j in range(a, b)]
            assert max(keys) < end
            for row, i in enumerate(range(chunk_start, chunk_end)):
                seen = set(keys[:len(keys) - (chunk_end - chunk_start) + row + 1])
                assert seen == set(allowed[i].nonzero().flatten().tolist())
                rows_seen += 1
    assert rows_seen == num_tokens


def _scoring_policy(policy32, **options) -> PolicyModel:
    return PolicyModel(policy32.model, max_query_tokens=5, **options)


@pytest.mark.parametrize("options", [
    {"head_chunk_tokens": 3, "max_segment_tokens": 0},
    {"head_chunk_tokens": 3, "max_segment_tokens": 7},
    {"head_chunk_tokens": 0, "max_segment_tokens": 1},
], ids=["chunked-head", "segments-of-7", "segments-of-1"])
def test_scores_equal_the_flat_per_path_scores(policy32, options):
    tree = build_random_tree(3, num_sessions=3, num_turns=3)
    advantages = {(tree.group_id, s): 1.0 for s in tree.sessions}
    step = pack_step([tree], advantages, 10**6)
    micro_batch = step.micro_batches[0]
    policy = _scoring_policy(policy32, **options)
    assert options["max_segment_tokens"] < micro_batch.num_tokens
    flat = PolicyModel(policy32.model, head_chunk_tokens=0)
    with torch.no_grad():
        scores = policy.score(micro_batch, with_entropy=True)
    assert_scores_equal_per_path(step, scores, [tree], advantages, flat)


def _gradients(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_gradients_close(got, expected):
    for name, reference in expected.items():
        scale = reference.abs().max()
        assert scale > 0, f"{name}: zero gradient, the comparison would be vacuous"
        error = (got[name] - reference).abs().max()
        assert error <= RTOL * scale, f"{name}: {error:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-ckpt"])
def test_segmented_loss_and_gradients_equal_the_flat_reference(random_trees, policy32,
                                                               checkpointing):
    """The objective with the entropy term (so the entropy's gradient is checked too)
    over segments of 9 positions and head chunks of 4 rows."""
    model = copy.deepcopy(policy32.model)
    model.zero_grad(set_to_none=True)
    config = LossConfig(name="grpo", correction="none", entropy_coef=0.05)
    advantages = {(t.group_id, s): (-1.0) ** i * (i + 1) / 3
                  for t in random_trees for i, s in enumerate(t.sessions)}
    flat_policy = PolicyModel(model, head_chunk_tokens=0, max_segment_tokens=0)
    flat = flat_loss(flat_policy, flat_samples(random_trees, advantages), config)
    flat_grads = _gradients(model)
    policy = PolicyModel(model, max_query_tokens=5, head_chunk_tokens=4, max_segment_tokens=9,
                         activation_checkpointing=checkpointing)
    step = pack_step(random_trees, advantages, 10**6)
    assert all(mb.num_tokens > 9 for mb in step.micro_batches)
    stats = backward_step(policy, step, config)
    assert abs(stats["loss"] - flat) <= RTOL * stats["loss_abs_sum"]
    _assert_gradients_close(_gradients(model), flat_grads)


def test_segments_under_no_grad_keep_no_graph(policy32):
    tree = build_random_tree(6, num_sessions=2, num_turns=3)
    step = pack_step([tree], {(tree.group_id, s): 1.0 for s in tree.sessions}, 10**6)
    policy = _scoring_policy(policy32, head_chunk_tokens=2, max_segment_tokens=4)
    with torch.no_grad():
        scores = policy.score(step.micro_batches[0], with_entropy=True)
    assert not scores.logprobs.requires_grad
    assert scores.logprobs.shape == scores.entropy.shape == (step.num_terms,)
    assert bool((scores.logprobs < 0).all()) and bool((scores.entropy > 0).all())


def test_bad_chunk_sizes_are_refused(policy32):
    with pytest.raises(ValueError, match="head_chunk_tokens"):
        PolicyModel(policy32.model, head_chunk_tokens=-1)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_scores(torch.nn.Linear(2, 3), torch.zeros(1, 2), torch.zeros(1, dtype=torch.long),
                       False, 0)


def test_a_path_longer_than_the_budget_trains_whole_in_segments(policy32):
    """long_paths="whole": the subtree that does not fit is one micro-batch with its
    context once (no context repeated per unit, as "split" does), scored in segments
    of the budget; loss and gradients equal the flat reference."""
    tree = build_random_tree(8, num_sessions=2, num_turns=12, rewrite_prob=0.2)
    advantages = {(tree.group_id, "s0"): 1.0, (tree.group_id, "s1"): -0.5}
    budget = 24
    split = pack_step([tree], advantages, budget)
    whole = pack_step([tree], advantages, budget, long_paths="whole")
    assert max(mb.num_tokens for mb in whole.micro_batches) > 3 * budget
    # Only the shared prefix (10 tokens) is repeated, once per micro-batch below it.
    num_repeated = whole.num_packed_tokens - whole.num_unique_tokens
    assert num_repeated <= 10 * len(whole.micro_batches)
    assert whole.num_packed_tokens < split.num_packed_tokens
    model = copy.deepcopy(policy32.model)
    model.zero_grad(set_to_none=True)
    config = LossConfig(name="token_mean", correction="none")
    flat = flat_loss(PolicyModel(model, head_chunk_tokens=0, max_segment_tokens=0),
                     flat_samples([tree], advantages), config)
    flat_grads = _gradients(model)
    policy = PolicyModel(model, max_query_tokens=8, head_chunk_tokens=16,
                         max_segment_tokens=budget)
    stats = backward_step(policy, whole, config)
    assert stats["num_terms"] == whole.num_terms
    assert abs(stats["loss"] - flat) <= RTOL * stats["loss_abs_sum"]
    _assert_gradients_close(_gradients(model), flat_grads)


def test_an_unknown_long_paths_mode_is_refused():
    tree = build_random_tree(1)
    with pytest.raises(ValueError, match="long_paths"):
        pack_step([tree], {(tree.group_id, "s0"): 1.0}, 10, long_paths="drop")


def _largest_saved_numel(score, head, hidden, targets) -> int:
    """The largest tensor autograd keeps for the backward of `score` (parameters aside)."""
    sizes = []
    parameters = {id(p) for p in head.parameters()}

    def pack(tensor):
        if id(tensor) not in parameters:
            sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = score(head, hidden, targets, True)
    (logprobs.sum() + entropy.sum()).backward()
    return max(sizes)


def test_the_chunked_head_keeps_no_tensor_with_a_vocabulary_dimension():
    generator = torch.Generator().manual_seed(1)
    num_rows, vocab = 300, 1000
    head = torch.nn.Linear(16, vocab, bias=False)
    hidden = torch.randn(num_rows, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (num_rows,), generator=generator)
    full = _largest_saved_numel(head_scores, head, hidden, targets)
    chunked = _largest_saved_numel(lambda *a: chunked_scores(*a, chunk_tokens=32),
                                   head, hidden, targets)
    assert full >= num_rows * vocab
    assert chunked == num_rows * 16      # the hidden rows, nothing of size V
