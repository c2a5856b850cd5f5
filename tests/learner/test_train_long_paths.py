"""Long paths through the run config: `learner.long_paths`, `learner.max_segment_tokens`
and `learner.head_chunk_tokens` read from a YAML run config reach the learner's policy
(and, in a pool run, the members' policies through the elastic step), a path longer
than the micro-batch bound trains with `long_paths: whole` exactly as one unsegmented,
unchunked micro-batch would, and fails with an error naming the field without it.

Real parts: the tiny model, `Learner`, `ElasticLearner` with its `Coordinator` and an
elastic `Member` in a thread; the config read by `undertow.config` from a YAML file.
"""

import random
import threading

import pytest
import torch

from undertow.cells.elastic.learner import ElasticLearner
from undertow.cells.elastic.step import Member
from undertow.config import build_section, read_config
from undertow.gateway.trees.tree import Tree
from undertow.learner.config import LONG_PATHS, AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.errors import MicroBatchTooLongError
from undertow.learner.packing import LONG_PATHS as PACKING_LONG_PATHS
from undertow.learner.train import Learner

MAX_TOKENS = 64
RUN_CONFIG = f"""
learner:
  lr: 0.001
  group_size: 2
  max_tokens: {MAX_TOKENS}
  long_paths: whole
  max_segment_tokens: 48
  head_chunk_tokens: 16
loss:
  entropy_coef: 0.01
"""


def long_tree(group_id: str = "g") -> Tree:
    """Two sessions on one task, each a single path of 146 tokens (4 calls of 8
    sampled tokens between 30-token observations), far over `MAX_TOKENS`."""
    rng = random.Random(7)
    tree = Tree(group_id)
    task = [rng.randrange(6000) for _ in range(24)]
    for index in range(2):
        prompt = list(task)
        for call in range(4):
            completion = [rng.randrange(6000) for _ in range(8)]
            tree.add_call(f"s{index}-{call}", f"s{index}", prompt, completion,
                          [rng.uniform(-9.5, -8.0) for _ in completion], [0] * 8)
            prompt = prompt + completion + [rng.randrange(6000) for _ in range(30)]
        tree.close_session(f"s{index}", reward=float(index == 0))
    return tree


def sections(tmp_path, *overrides: str):
    path = tmp_path / "run.yaml"
    path.write_text(RUN_CONFIG)
    tree = read_config(path, list(overrides))
    return (build_section(TrainConfig, tree["learner"], "learner"),
            build_section(LossConfig, tree["loss"], "loss"))


def learner_of(tiny_model_dir, run_dir, config, loss, cls=Learner):
    return cls(config, loss, AdvantageConfig(), tiny_model_dir, run_dir)


def parameters(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.policy.model.named_parameters()}


def assert_same_gradients(learner, expected) -> None:
    """The step's (clipped) gradients, left in `.grad`, within 1e-5 of the largest."""
    got = dict(learner.policy.model.named_parameters())
    for name, parameter in expected.policy.model.named_parameters():
        scale = float(parameter.grad.abs().max())
        assert scale > 0 and torch.allclose(got[name].grad, parameter.grad, rtol=0,
                                            atol=1e-5 * scale), name


def test_the_config_values_reach_the_policy(tiny_model_dir, tmp_path):
    config, loss = sections(tmp_path, "learner.head_chunk_tokens=24")
    learner = learner_of(tiny_model_dir, tmp_path / "a", config, loss)
    assert (learner.policy.head_chunk_tokens, learner.policy.max_segment_tokens) == (24, 48)
    config, loss = sections(tmp_path, "learner.max_segment_tokens=null",
                            "learner.micro_batch_tokens=40")
    learner = learner_of(tiny_model_dir, tmp_path / "b", config, loss)
    # null: segments of the micro-batch bound, here `micro_batch_tokens`.
    assert learner.placement.max_tokens == 40 and learner.policy.max_segment_tokens == 40


def test_a_path_longer_than_the_bound_trains_whole_as_one_flat_micro_batch(tiny_model_dir,
                                                                           tmp_path):
    config, loss = sections(tmp_path)
    learner = learner_of(tiny_model_dir, tmp_path / "whole", config, loss)
    tree = long_tree()
    step = learner.pack([tree], {(tree.group_id, "s0"): 1.0}, MAX_TOKENS)
    assert max(mb.num_tokens for mb in step.micro_batches) == 146 > 2 * MAX_TOKENS
    # The same step as one micro-batch, no segments, the head unchunked.
    flat_config, _ = sections(tmp_path, "learner.max_tokens=4096",
                              "learner.max_segment_tokens=0", "learner.head_chunk_tokens=0")
    flat = learner_of(tiny_model_dir, tmp_path / "flat", flat_config, loss)
    metrics, expected = learner.train_step([tree]), flat.train_step([tree])
    assert metrics["num_trained_tokens"] == expected["num_trained_tokens"] == 64
    for name in ("loss", "grad_norm", "entropy"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    assert_same_gradients(learner, flat)


def test_without_long_paths_whole_the_step_fails_naming_the_field(tiny_model_dir, tmp_path):
    config, loss = sections(tmp_path, "learner.long_paths=split")
    learner = learner_of(tiny_model_dir, tmp_path, config, loss)
    before = parameters(learner)
    with pytest.raises(MicroBatchTooLongError, match=r"learner\.long_paths: whole") as error:
        learner.train_step([long_tree()])
    assert f"bound of {MAX_TOKENS}" in str(error.value)
    assert learner.state.step == 0
    assert all(torch.equal(p, before[n]) for n, p in parameters(learner).items())


def test_a_bad_long_paths_value_is_refused_naming_it(tmp_path):
    assert LONG_PATHS == PACKING_LONG_PATHS
    with pytest.raises(ValueError, match=r"learner\.long_paths"):
        sections(tmp_path, "learner.long_paths=chunks")
    with pytest.raises(ValueError, match=r"learner\.max_segment_tokens"):
        sections(tmp_path, "learner.max_segment_tokens=-1")
    with pytest.raises(ValueError, match=r"learner\.head_chunk_tokens"):
        sections(tmp_path, "learner.head_chunk_tokens=-8")


def test_a_pool_member_scores_with_the_run_configs_options(tiny_model_dir, tmp_path):
    """A pool run's learner packs the long path whole and its member, loaded with the
    model's defaults, trains it with the config's chunk and segment sizes."""
    config, loss = sections(tmp_path)
    learner = learner_of(tiny_model_dir, tmp_path / "pool", config, loss, ElasticLearner)
    member = Member(learner.coordinator.address, "cell-0", tiny_model_dir, timeout_s=60)
    assert (member.policy.head_chunk_tokens, member.policy.max_segment_tokens) != (16, 48)
    joined = threading.Thread(target=member.join, args=(0,))
    try:
        learner.open_step()
        joined.start()
        assert learner.add_group(long_tree()) == 1    # both chains, longer than the bound
        metrics = learner.train_step([long_tree()])
    finally:
        if learner.coordinator.step_open:    # a failed check: let the member go
            learner.coordinator.abort_step()
        joined.join(timeout=60)
        learner.close()
    assert (member.policy.head_chunk_tokens, member.policy.max_segment_tokens) == (16, 48)
    flat_config, _ = sections(tmp_path, "learner.max_tokens=4096")
    flat = learner_of(tiny_model_dir, tmp_path / "flat", flat_config, loss)
    expected = flat.train_step([long_tree()])
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert_same_gradients(learner, flat)


def test_a_pool_learner_packs_with_the_resolved_micro_batch_bound(tiny_model_dir, tmp_path):
    """`learner.micro_batch_tokens` bounds a pool run's micro-batches as it bounds a plain
    run's (it was once ignored there for `learner.max_tokens`)."""
    config, loss = sections(tmp_path, "learner.long_paths=split", "learner.micro_batch_tokens=40")
    learner = learner_of(tiny_model_dir, tmp_path / "pool", config, loss, ElasticLearner)
    with pytest.raises(MicroBatchTooLongError, match=r"bound of 40 "):
        learner.add_group(long_tree())
