"""Losses: per-token terms and normalisers by hand, and the tree-packed loss and every
gradient equal to the flat per-session computation for every variant and split."""

import copy
import dataclasses
import math

import pytest
import torch

from undertow.config import build_section
from undertow.gateway.trees.tree import Tree
from undertow.learner.config import CORRECTION_NAMES, LOSS_NAMES, LossConfig
from undertow.learner.errors import LossConfigError
from undertow.learner.losses import CORRECTIONS, LOSSES, sequence_keep, term_weights, token_terms
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.reference import flat_loss, flat_samples

# Relative to the scale of each sum: the loss to the sum of its terms' magnitudes (it
# may cancel to near zero across sessions), a gradient to its largest entry.
RTOL = 1e-5
LOGPROBS = [-1.0, -2.0, -0.5]
BEHAVIOUR = [-1.1, -1.5, -1.5]
ADVANTAGES = [1.0, -2.0, 0.5]


def _terms(correction, **extra):
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    config = LossConfig(correction=correction, max_importance_weight=1.5, **extra)
    terms, stats = token_terms(config, logprobs, torch.tensor(BEHAVIOUR),
                               torch.tensor(ADVANTAGES), **_extra_inputs(extra))
    terms.sum().backward()
    return terms.detach().tolist(), logprobs.grad.tolist(), stats


def _extra_inputs(extra):
    inputs = {}
    if extra.get("kl_coef"):
        inputs["ref_logprobs"] = torch.tensor([-1.2, -2.0, -0.4], dtype=torch.float64)
    if extra.get("entropy_coef"):
        inputs["entropy"] = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    return inputs


def test_ppo_against_the_behaviour_policy_by_hand():
    terms, grads, stats = _terms("none")
    rho0 = math.exp(0.1)
    # t0 unclipped; t1 (A<0, rho<0.8) clipped at 0.8; t2 (A>0, rho>1.2) clipped at 1.2.
    assert terms == pytest.approx([-rho0, 0.8 * 2.0, -1.2 * 0.5])
    assert grads == pytest.approx([-rho0, 0.0, 0.0])
    assert stats["num_clipped"] == 2


def test_decoupled_ppo_drops_tokens_over_the_weight_cap():
    terms, grads, stats = _terms("decoupled_ppo")
    w0, w1 = math.exp(0.1), math.exp(-0.5)   # w2 = e > 1.5: dropped
    assert terms == pytest.approx([-w0 * 1.0, w1 * 2.0, 0.0])
    assert grads == pytest.approx([-w0, w1 * 2.0, 0.0])
    assert stats["num_dropped"] == 1


def test_tis_truncates_the_weight():
    terms, grads, _ = _terms("tis")
    w0, w1 = math.exp(0.1), math.exp(-0.5)
    assert terms == pytest.approx([-w0, w1 * 2.0, -1.5 * 0.5])
    assert grads == pytest.approx([-w0, w1 * 2.0, -1.5 * 0.5])


def test_mis_masks_tokens_whose_ratio_leaves_the_band():
    # Ratios exp(l - mu) = [e^0.1, e^-0.5, e^1.0]: with [0.7, 2.0] only t0 stays.
    terms, grads, stats = _terms("mis", mis_low=0.7, mis_high=2.0)
    w0 = math.exp(0.1)
    assert terms == pytest.approx([-w0, 0.0, 0.0])
    assert grads == pytest.approx([-w0, 0.0, 0.0])
    assert stats["num_dropped"] == 2
    # With IcePop's band [0.5, 5] every ratio is inside: the untruncated weights.
    terms, grads, stats = _terms("mis")
    w1, w2 = math.exp(-0.5), math.exp(1.0)
    assert terms == pytest.approx([-w0, w1 * 2.0, -w2 * 0.5])
    assert grads == pytest.approx([-w0, w1 * 2.0, -w2 * 0.5])
    assert stats["num_dropped"] == 0


def test_geometric_sequence_mask_by_hand():
    session = torch.tensor([0, 0, 1, 1, 1, 2])
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -0.7, -3.0, -1.0], dtype=torch.float64)
    behaviour = torch.tensor([-1.001, -1.998, -0.5, -0.69, -3.02, -1.0], dtype=torch.float64)
    # g0 = exp((0.001 - 0.002) / 2), g1 = exp((0 - 0.01 + 0.02) / 3), g2 = 1.
    g0, g1 = math.exp(-0.0005), math.exp(0.01 / 3)
    config = LossConfig(sequence_mask="geometric", sequence_mask_low=0.999,
                        sequence_mask_high=1.003)
    assert g0 >= 0.999 and g1 > 1.003
    keep = sequence_keep(config, logprobs, behaviour, session)
    assert keep.tolist() == [True, True, False, False, False, True]
    assert sequence_keep(LossConfig(), logprobs, behaviour, session).all()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 2.0])
    live = logprobs.clone().requires_grad_(True)
    terms, stats = token_terms(config, live, behaviour, advantages, keep=keep)
    terms.sum().backward()
    assert terms.detach().tolist()[2:5] == [0.0, 0.0, 0.0]
    assert live.grad.tolist()[2:5] == [0.0, 0.0, 0.0]
    assert terms.detach().tolist()[5] == pytest.approx(-2.0)
    assert stats["num_sequence_masked"] == 3 and stats["num_dropped"] == 3
    with pytest.raises(LossConfigError, match="keep mask"):
        token_terms(config, live, behaviour, advantages)


@pytest.mark.parametrize(("fields", "named"), [
    ({"mis_low": 0.0}, "low=0.0"), ({"mis_high": 0.9}, "high=0.9"),
    ({"sequence_mask_low": 1.01}, "low=1.01"), ({"sequence_mask": "arithmetic"}, "geometric")])
def test_bad_mask_settings_are_rejected_naming_the_value(fields, named):
    with pytest.raises(ValueError, match=named):
        LossConfig(**fields)


def test_kl_k3_and_entropy_bonus_by_hand():
    base_terms, base_grads, _ = _terms("tis")
    terms, grads, stats = _terms("tis", kl_coef=0.1, entropy_coef=0.01)
    ref = [-1.2, -2.0, -0.4]
    k3 = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip(ref, LOGPROBS, strict=True)]
    expected = [b + 0.1 * k - 0.01 * h
                for b, k, h in zip(base_terms, k3, [3.0, 2.0, 1.0], strict=True)]
    assert terms == pytest.approx(expected)
    dk3 = [1 - math.exp(r - lp) for r, lp in zip(ref, LOGPROBS, strict=True)]
    assert grads == pytest.approx([g + 0.1 * d for g, d in zip(base_grads, dk3, strict=True)])
    assert stats["kl_sum"] == pytest.approx(sum(k3))


def test_normalisers_by_hand():
    session = torch.tensor([0, 0, 0, 1])
    path = torch.tensor([0, 1, 1, 0])

    def weights(name):
        return term_weights(LossConfig(name=name, dr_grpo_num_tokens=10), session, path).tolist()

    assert weights("token_mean") == pytest.approx([1 / 4] * 4)
    assert weights("grpo") == pytest.approx([1 / 6, 1 / 6, 1 / 6, 1 / 2])
    assert weights("dr_grpo") == pytest.approx([1 / 20] * 4)
    # s0: two paths (1 and 2 tokens) averaged, then the two sessions averaged.
    assert weights("gyre") == pytest.approx([1 / 4, 1 / 8, 1 / 8, 1 / 2])


def test_unknown_names_are_rejected_with_the_choices():
    with pytest.raises(LossConfigError, match="token_mean"):
        LossConfig(name="ppo2")
    with pytest.raises(LossConfigError, match="decoupled_ppo"):
        LossConfig(correction="vtrace")
    with pytest.raises(ValueError, match=r"\[loss\] unknown keys \['clip_lo'\]"):
        build_section(LossConfig, {"clip_lo": 0.1}, "loss")   # as `undertow train` builds it
    assert build_section(LossConfig, {"name": "dr_grpo"}, "loss").name == "dr_grpo"


def test_the_config_knows_every_loss_and_correction_and_no_other():
    # learner/config.py names them without importing torch; losses.py defines them
    assert sorted(LOSS_NAMES) == sorted(LOSSES)
    assert sorted(CORRECTION_NAMES) == sorted(CORRECTIONS)


# mis's band [0.8, 1.5] masks some of the random trees' tokens (ratios e^-0.7..e^0.7).
VARIANTS = [LossConfig(name=n, correction=c, max_importance_weight=1.5, mis_low=0.8,
                       mis_high=1.5) for n in LOSSES for c in CORRECTIONS]
VARIANTS += [LossConfig(name="grpo", correction="decoupled_ppo", kl_coef=0.1,
                        entropy_coef=0.01, clip_high=0.28),
             LossConfig(name="gyre", correction="none", max_paths_per_session=1, kl_coef=0.05)]


def _advantages(trees):
    from undertow.learner.advantages import group_advantages
    from undertow.learner.config import AdvantageConfig

    return {(t.group_id, s): a for t in trees
            for s, a in group_advantages(t, AdvantageConfig()).items()}


def _gradients(policy):
    grads = {name: p.grad.clone() for name, p in policy.model.named_parameters()}
    policy.model.zero_grad(set_to_none=True)
    return grads


def _assert_gradients_close(tree_grads, flat_grads):
    for name, flat in flat_grads.items():
        scale = flat.abs().max()
        assert scale > 0, f"{name}: zero gradient, the comparison would be vacuous"
        error = (tree_grads[name] - flat).abs().max()
        assert error <= RTOL * scale, f"{name}: {error:.3g} vs scale {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: f"{c.name}-{c.correction}"
                         + ("-kl" if c.kl_coef else "") + ("-ent" if c.entropy_coef else ""))
def test_tree_equals_flat_per_session(random_trees, policy32, reference32, config):
    advantages = _advantages(random_trees)
    policy32.model.zero_grad(set_to_none=True)
    samples = flat_samples(random_trees, advantages, "session", config.paths_per_session)
    flat = flat_loss(policy32, samples, config, reference32)
    flat_grads = _gradients(policy32)
    for budget in (10**6, 40):
        step = pack_step(random_trees, advantages, budget, config.paths_per_session)
        stats = backward_step(policy32, step, config, reference32)
        assert abs(stats["loss"] - flat) <= RTOL * stats["loss_abs_sum"]
        assert stats["num_terms"] == sum(len(s.path_index) for s in samples)
        _assert_gradients_close(_gradients(policy32), flat_grads)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [10**6, 48, 16, 5])
def test_tree_equals_flat_across_micro_batch_splits(random_trees, policy32, budget):
    config = LossConfig(name="token_mean", correction="none")
    advantages = _advantages(random_trees)
    flat = flat_loss(policy32, flat_samples(random_trees, advantages), config)
    flat_grads = _gradients(policy32)
    step = pack_step(random_trees, advantages, budget)
    assert len(step.micro_batches) >= (1 if budget > 10**5 else 2)
    stats = backward_step(policy32, step, config)
    assert abs(stats["loss"] - flat) <= RTOL * stats["loss_abs_sum"]
    _assert_gradients_close(_gradients(policy32), flat_grads)


def _geometric_band(policy, trees, advantages):
    """A sequence-mask band [1/h, h] that masks about half of the step's sessions."""
    step = pack_step(trees, advantages, 10**6)
    with torch.no_grad():
        logprobs = policy.score(step.micro_batches[0]).logprobs.double()
    order = step.micro_batches[0].term_ids
    log_ratio = torch.zeros(step.num_terms, dtype=torch.float64)
    log_ratio[order] = logprobs - step.behaviour_logprobs[order]
    sessions = step.term_session
    means = [float(log_ratio[sessions == s].mean()) for s in range(len(step.session_keys))]
    return math.exp(sorted(abs(m) for m in means)[len(means) // 2 - 1] * 1.0001)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "correction"), [("grpo", "none"), ("token_mean", "mis"),
                                                  ("gyre", "tis")])
def test_tree_equals_flat_with_the_geometric_sequence_mask(random_trees, policy32, name,
                                                           correction):
    advantages = _advantages(random_trees)
    high = _geometric_band(policy32, random_trees, advantages)
    config = LossConfig(name=name, correction=correction, sequence_mask="geometric",
                        sequence_mask_low=1 / high, sequence_mask_high=high, mis_low=0.8,
                        mis_high=1.5, max_importance_weight=1.5)
    policy32.model.zero_grad(set_to_none=True)
    samples = flat_samples(random_trees, advantages, "session", config.paths_per_session)
    flat = flat_loss(policy32, samples, config)
    flat_grads = _gradients(policy32)
    for budget in (10**6, 40):
        step = pack_step(random_trees, advantages, budget, config.paths_per_session)
        stats = backward_step(policy32, step, config)
        assert abs(stats["loss"] - flat) <= RTOL * stats["loss_abs_sum"]
        masked_sessions = set(step.term_session[~step.sequence_keep].tolist())
        assert 0 < len(masked_sessions) < len(step.session_keys)
        assert stats["num_sequence_masked"] == float((~step.sequence_keep).sum())
        _assert_gradients_close(_gradients(policy32), flat_grads)


@pytest.mark.slow
def test_clipping_and_dropping_are_exercised(random_trees, policy32):
    advantages = _advantages(random_trees)
    step = pack_step(random_trees, advantages, 10**6)
    with torch.no_grad():
        none = backward_step(policy32, step, LossConfig(), backward=False)
        dropped = backward_step(policy32, step, LossConfig(correction="decoupled_ppo",
                                                           max_importance_weight=1.5),
                                backward=False)
    assert 0 < none["num_clipped"] < none["num_terms"]
    assert 0 < dropped["num_dropped"] < dropped["num_terms"]
    with torch.no_grad():
        masked = backward_step(policy32, step, LossConfig(correction="mis", mis_low=0.8,
                                                          mis_high=1.5), backward=False)
    assert 0 < masked["num_dropped"] < masked["num_terms"]


def test_one_sample_per_call_trains_the_same_tokens_as_per_session(random_trees):
    advantages = _advantages(random_trees)
    by_session = flat_samples(random_trees, advantages, "session")
    by_call = flat_samples(random_trees, advantages, "call")
    assert len(by_call) > len(by_session)

    def tokens(samples):
        return sorted((s.session, float(b)) for s in samples for b in s.behaviour)

    assert tokens(by_call) == tokens(by_session)


def test_version_gap_mask_by_hand():
    # Gaps [0, 2, 1] with at most 1 allowed: t1 is masked, its term and gradient 0.
    config = LossConfig(correction="tis", max_importance_weight=1.5, max_token_version_gap=1)
    logprobs = torch.tensor(LOGPROBS, dtype=torch.float64, requires_grad=True)
    terms, stats = token_terms(config, logprobs, torch.tensor(BEHAVIOUR),
                               torch.tensor(ADVANTAGES), version_gap=torch.tensor([0, 2, 1]))
    terms.sum().backward()
    w0 = math.exp(0.1)
    assert terms.detach().tolist() == pytest.approx([-w0, 0.0, -1.5 * 0.5])
    assert logprobs.grad.tolist() == pytest.approx([-w0, 0.0, -1.5 * 0.5])
    assert stats["num_version_masked"] == 1 and stats["num_dropped"] == 1
    with pytest.raises(LossConfigError, match="version gaps"):
        token_terms(config, logprobs, torch.tensor(BEHAVIOUR), torch.tensor(ADVANTAGES))
    # Off (None), the gaps change nothing.
    off, stats = token_terms(LossConfig(correction="tis", max_importance_weight=1.5),
                             logprobs, torch.tensor(BEHAVIOUR), torch.tensor(ADVANTAGES),
                             version_gap=torch.tensor([0, 2, 1]))
    assert off.detach().tolist() == pytest.approx([-w0, math.exp(-0.5) * 2.0, -1.5 * 0.5])
    assert "num_version_masked" not in stats


@pytest.mark.parametrize("gap", [-1, 1.5, "2"])
def test_a_bad_version_gap_is_rejected_naming_it(gap):
    with pytest.raises(ValueError, match=f"max_token_version_gap .* got {gap!r}"):
        LossConfig(max_token_version_gap=gap)


def _versioned(trees, num_versions=4):
    """Copies of `trees` whose sampled tokens carry versions 0..num_versions-1, varying
    from token to token (a session's calls, and even one call, sampled by several)."""
    trees = copy.deepcopy(trees)
    for tree in trees:
        for node_id, node in tree.nodes.items():
            if node.sampled_by is not None:
                node.weight_versions = [(node_id + offset) % num_versions
                                        for offset in range(len(node.token_ids))]
    return trees


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    LossConfig(name="grpo", correction="decoupled_ppo", max_importance_weight=1.5,
               max_token_version_gap=1),
    LossConfig(name="token_mean", correction="none", max_token_version_gap=0),
    LossConfig(name="gyre", correction="mis", mis_low=0.8, mis_high=1.5,
               max_token_version_gap=2),
    LossConfig(name="dr_grpo", correction="tis", max_importance_weight=1.5),
], ids=lambda c: f"{c.name}-{c.correction}-gap{c.max_token_version_gap}")
def test_tree_equals_flat_with_the_version_mask(random_trees, policy32, config):
    trees = _versioned(random_trees)
    advantages = _advantages(trees)
    policy32.model.zero_grad(set_to_none=True)
    samples = flat_samples(trees, advantages, "session", config.paths_per_session)
    flat = flat_loss(policy32, samples, config, weight_version=3)
    flat_grads = _gradients(policy32)
    for budget in (10**6, 40):
        step = pack_step(trees, advantages, budget, config.paths_per_session,
                         weight_version=3)
        stats = backward_step(policy32, step, config)
        assert abs(stats["loss"] - flat) <= RTOL * stats["loss_abs_sum"]
        if config.max_token_version_gap is not None:
            stale = int((step.term_version_gap > config.max_token_version_gap).sum())
            assert 0 < stats["num_version_masked"] == stale < stats["num_terms"]
        _assert_gradients_close(_gradients(policy32), flat_grads)


def _two_version_session(tiny_model_dir, old, new):
    """One session of two calls: the first sampled by `old` (version 0), the second,
    after a weight update, by `new` (version 1); each call's logprobs are its sampler's
    own (as the engine records them). Returns the tree and the session's token IDs and
    scored positions."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    prompt, first = encode("Look up the key alpha."), encode("lookup(alpha)")
    observation, second = encode("The value is 42."), encode("The answer is 42.")
    tree = Tree("g")
    path = prompt + first
    with torch.no_grad():
        mu_first = old.score_path(torch.tensor(path), torch.arange(len(prompt), len(path)))
        prompt_2 = path + observation
        path_2 = prompt_2 + second
        mu_second = new.score_path(torch.tensor(path_2),
                                   torch.arange(len(prompt_2), len(path_2)))
    tree.add_call("c0", "s", prompt, first, mu_first.logprobs.double().tolist(),
                  [0] * len(first))
    tree.add_call("c1", "s", prompt_2, second, mu_second.logprobs.double().tolist(),
                  [1] * len(second))
    scored = list(range(len(prompt), len(path))) + list(range(len(prompt_2), len(path_2)))
    return tree, path_2, scored, len(first)


@pytest.mark.slow
def test_each_token_is_corrected_against_the_version_that_sampled_it(tiny_model_dir, policy32,
                                                                      reference32):
    # Version 0 is `reference32` (the policy's weights plus noise), version 1 the policy
    # itself: the step trains version 1, so the second call is on-policy (w = 1) and the
    # first is weighted by exp(l - mu_0) with its own sampler's logprobs.
    tree, path, scored, num_first = _two_version_session(tiny_model_dir, reference32, policy32)
    advantages = {("g", "s"): 1.0}
    with torch.no_grad():
        logprobs = policy32.score_path(torch.tensor(path), torch.tensor(scored)).logprobs
        behaviour = reference32.score_path(torch.tensor(path), torch.tensor(scored)).logprobs
    behaviour = torch.cat([behaviour[:num_first], logprobs[num_first:]]).double()
    weights = torch.exp(logprobs.double() - behaviour)
    assert (weights[:num_first] - 1).abs().max() > 1e-3   # the versions do differ
    config = LossConfig(name="token_mean", correction="tis", max_importance_weight=100.0)
    step = pack_step([tree], advantages, 10**6, weight_version=1)
    assert step.term_version_gap.tolist() == [1] * num_first + [0] * (len(scored) - num_first)
    with torch.no_grad():
        stats = backward_step(policy32, step, config, backward=False)
    # tis with rho = 1 at the current weights: f_t = -w_t * A, the mean over the tokens.
    assert stats["importance_weight_sum"] == pytest.approx(float(weights.sum()), rel=1e-5)
    assert stats["loss"] == pytest.approx(-float(weights.mean()), rel=1e-5)
    # Masking the first call's tokens (gap 1 > 0) keeps them in the normaliser.
    masked = dataclasses.replace(config, max_token_version_gap=0)
    with torch.no_grad():
        stats = backward_step(policy32, step, masked, backward=False)
    assert stats["num_version_masked"] == num_first
    assert stats["loss"] == pytest.approx(-float(weights[num_first:].sum()) / len(scored),
                                          rel=1e-5)
