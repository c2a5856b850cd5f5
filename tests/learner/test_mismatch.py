"""Train/sample mismatch metrics: the mergeable sums and quantiles by hand, split
invariance, and a training step on a tiny tree whose behaviour logprobs sit at chosen
distances from the learner's, so that every metric of the step is known by hand."""

import math

import pytest
import torch

from undertow.gateway.trees.tree import Tree
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.metrics_log import read_metrics
from undertow.learner.mismatch import (
    mismatch_metrics,
    mismatch_sums,
    ratio_bins,
    version_gap_sums,
)
from undertow.learner.objective import merge_stats
from undertow.learner.train import Learner

# d = logprob(learner) - logprob(engine) of each trained token, per session.
DISTANCES = {"s0": [0.02, -0.3, 0.005, 0.15], "s1": [-0.04, 0.6, -0.001]}
ALL = sorted(d for ds in DISTANCES.values() for d in ds)
PROMPT = [11, 12, 13, 14, 15]
COMPLETIONS = {"s0": [21, 22, 23, 24], "s1": [31, 32, 33]}
REWARDS = {"s0": 1.0, "s1": 0.0}


def _stats(distances):
    behaviour = torch.zeros(len(distances), dtype=torch.float64)
    return mismatch_sums(torch.tensor(distances, dtype=torch.float64), behaviour)


def test_sums_and_quantiles_by_hand_and_whatever_the_split():
    whole = _stats(ALL)
    halves = merge_stats(merge_stats({}, _stats(ALL[:3])), _stats(ALL[3:]))
    thirds = {}
    for part in (ALL[:1], ALL[1:5], ALL[5:]):
        merge_stats(thirds, _stats(part))
    assert halves == pytest.approx(whole) and thirds == pytest.approx(whole)
    metrics = mismatch_metrics({**whole, "num_terms": 7.0, "num_dropped": 2.0})
    # Nearest rank over 7 tokens: p5 is the 1st, p50 the 4th, p95 the 7th.
    assert metrics == pytest.approx({
        "mismatch_mean": sum(abs(d) for d in ALL) / 7, "mismatch_max": 0.6,
        "ratio_p5": math.exp(-0.3), "ratio_p50": math.exp(0.005), "ratio_p95": math.exp(0.6),
        "masked_fraction": 2 / 7})
    assert mismatch_metrics({}) == {}


def test_a_quantile_is_within_its_bin():
    # Two values in one bin (within 12% of each other): the bin's mean is reported.
    log_ratio = torch.tensor([0.0100, 0.0105, 0.5], dtype=torch.float64)
    assert ratio_bins(log_ratio)[0] == ratio_bins(log_ratio)[1] != ratio_bins(log_ratio)[2]
    assert ratio_bins(torch.tensor([1e-7, -1e-7, -0.01])).tolist()[:2] == [0, 0]
    assert ratio_bins(torch.tensor([-0.01]))[0] == -ratio_bins(torch.tensor([0.01]))[0]
    metrics = mismatch_metrics({**_stats(log_ratio.tolist()), "num_terms": 3.0})
    assert metrics["ratio_p50"] == pytest.approx(math.exp(0.01025))


def _tree(behaviour):
    tree = Tree("g")
    for session_id, completion in COMPLETIONS.items():
        tree.add_call(f"{session_id}-0", session_id, PROMPT, completion, behaviour[session_id],
                      [0] * len(completion))
        tree.close_session(session_id, reward=REWARDS[session_id])
    return tree


def _learner_step(tiny_model_dir, run_dir, loss):
    """One step of a learner on the tiny tree whose behaviour logprobs are the learner's
    own (scored path by path, without the packer) minus DISTANCES."""
    learner = Learner(TrainConfig(lr=1e-3, group_size=2, num_steps=1), loss,
                      AdvantageConfig(), tiny_model_dir, run_dir)
    behaviour = {}
    with torch.no_grad():
        for session_id, completion in COMPLETIONS.items():
            token_ids = torch.tensor(PROMPT + completion)
            scored = torch.arange(len(PROMPT), len(token_ids))
            logprobs = learner.policy.score_path(token_ids, scored).logprobs.double()
            distances = torch.tensor(DISTANCES[session_id], dtype=torch.float64)
            behaviour[session_id] = (logprobs - distances).tolist()
    metrics = learner.train_step([_tree(behaviour)])
    learner.metrics.append(1, 1, metrics)
    return metrics


@pytest.mark.slow
@pytest.mark.parametrize(("loss", "num_masked", "num_sequence_masked"), [
    (LossConfig(), 0, None),
    # exp(-0.3) = 0.74 and exp(0.6) = 1.82 leave [0.8, 1.5].
    (LossConfig(correction="mis", mis_low=0.8, mis_high=1.5), 2, None),
    # Geometric means exp(-0.125 / 4) = 0.97 (s0, kept), exp(0.559 / 3) = 1.20 (s1, masked).
    (LossConfig(sequence_mask="geometric", sequence_mask_low=0.9, sequence_mask_high=1.1), 3, 3),
    (LossConfig(correction="mis", mis_low=0.8, mis_high=1.5, sequence_mask="geometric",
                sequence_mask_low=0.9, sequence_mask_high=1.1), 4, 3),
], ids=["none", "mis", "geometric", "mis+geometric"])
def test_a_training_step_reports_the_hand_computed_metrics(tiny_model_dir, tmp_path, loss,
                                                           num_masked, num_sequence_masked):
    metrics = _learner_step(tiny_model_dir, tmp_path, loss)
    expected = {"mismatch_mean": sum(abs(d) for d in ALL) / 7, "mismatch_max": 0.6,
                "ratio_p5": math.exp(-0.3), "ratio_p50": math.exp(0.005),
                "ratio_p95": math.exp(0.6), "masked_fraction": num_masked / 7}
    if num_sequence_masked is not None:
        expected["sequence_masked_fraction"] = num_sequence_masked / 7
    assert metrics["num_trained_tokens"] == 7
    # The packed forward equals the path-by-path one to float32 rounding.
    assert {k: metrics.get(k) for k in expected} == pytest.approx(expected, rel=1e-4,
                                                                   abs=1e-5)
    assert ("sequence_masked_fraction" in metrics) == (num_sequence_masked is not None)
    record = read_metrics(tmp_path)[0]
    assert {k: record[k] for k in expected} == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_version_gap_counts_by_hand_and_whatever_the_split():
    gaps = [0, 0, 1, 5, 2, 3, 0]
    whole = version_gap_sums(torch.tensor(gaps))
    assert whole == {"num_version_gap:0": 3.0, "num_version_gap:1": 1.0,
                     "num_version_gap:2": 1.0, "num_version_gap:3": 2.0}
    parts = merge_stats(merge_stats({}, version_gap_sums(torch.tensor(gaps[:2]))),
                        version_gap_sums(torch.tensor(gaps[2:])))
    assert parts == whole
    metrics = mismatch_metrics({**whole, "num_terms": 7.0, "num_version_masked": 3.0})
    assert {k: v for k, v in metrics.items() if "version" in k} == pytest.approx({
        "version_gap0_fraction": 3 / 7, "version_gap1_fraction": 1 / 7,
        "version_gap2_fraction": 1 / 7, "version_gap3plus_fraction": 2 / 7,
        "version_masked_fraction": 3 / 7})


@pytest.mark.slow
@pytest.mark.parametrize(("max_gap", "num_masked"), [(None, 0), (1, 2), (0, 4)])
def test_a_training_step_reports_tokens_by_version_gap(tiny_model_dir, tmp_path, max_gap,
                                                       num_masked):
    # A learner two steps in (it trains version 2): s0's four tokens were sampled by
    # versions [0, 0, 1, 2] (a session that outlived two updates), s1's three by [2, 1, 2].
    learner = Learner(TrainConfig(lr=1e-3, group_size=2, num_steps=3), LossConfig(
        max_token_version_gap=max_gap), AdvantageConfig(), tiny_model_dir, tmp_path)
    learner.state.step = 2
    versions = {"s0": [0, 0, 1, 2], "s1": [2, 1, 2]}
    tree = Tree("g")
    for session_id, completion in COMPLETIONS.items():
        tree.add_call(f"{session_id}-0", session_id, PROMPT, completion,
                      [-1.0] * len(completion), versions[session_id])
        tree.close_session(session_id, reward=REWARDS[session_id])
    metrics = learner.train_step([tree])
    learner.metrics.append(3, 3, metrics)
    expected = {"version_gap0_fraction": 3 / 7, "version_gap1_fraction": 2 / 7,
                "version_gap2_fraction": 2 / 7, "version_gap3plus_fraction": 0.0}
    if max_gap is not None:
        expected["version_masked_fraction"] = num_masked / 7
    record = read_metrics(tmp_path)[0]
    for values in (metrics, record):
        assert {k: v for k, v in values.items() if k.startswith("version_")} \
            == pytest.approx(expected)
        assert values["masked_fraction"] == pytest.approx(num_masked / 7)
