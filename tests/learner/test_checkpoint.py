"""Checkpoints: a round trip restores weights, optimizer, step, RNG and pending groups
exactly; a failed write leaves no trace; hidden temporaries are never read back."""

import random

import pytest
import torch

from undertow.gateway.trees.tree import tree_to_json
from undertow.learner.advantages import AdvantageConfig
from undertow.learner.checkpoint import (
    PendingGroup,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
)
from undertow.learner.config import TrainConfig
from undertow.learner.losses import LossConfig
from undertow.learner.train import Learner

from .conftest import build_random_tree

pytestmark = pytest.mark.slow


def _learner(tiny_model_dir, run_dir):
    return Learner(TrainConfig(lr=1e-3, keep_checkpoints=3), LossConfig(), AdvantageConfig(),
                   tiny_model_dir, run_dir, resolved_config={"learner": {"lr": 1e-3}})


def _parameters(learner):
    return {name: p.detach().clone() for name, p in learner.policy.model.named_parameters()}


def test_round_trip_restores_weights_optimizer_step_rng_and_pending(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    learner.train_step([build_random_tree(3, "g-a")])
    learner.pending = [PendingGroup(7, build_random_tree(4, "g-b"), rollout_s=1.5)]
    learner.state.num_launched, learner.state.consumed = 8, [0]
    torch.manual_seed(123)
    random.seed(5)
    path = learner.save(checkpoint=True)
    expected_draws = (torch.rand(3), random.random())

    restored = Learner.restore(learner.config, learner.loss, learner.advantage_config,
                               tiny_model_dir, tmp_path)
    assert (torch.rand(3).tolist(), random.random()) == (expected_draws[0].tolist(),
                                                         expected_draws[1])
    assert path.parent.name == "step-000001"
    assert restored.state.step == 1 and restored.state.num_launched == 8
    assert restored.state.consumed == [0] and restored.state.num_resumes == 1
    for name, value in _parameters(learner).items():
        assert torch.equal(dict(restored.policy.model.named_parameters())[name], value), name
    before, after = learner.optimizer.state_dict(), restored.optimizer.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for key, state in before["state"].items():
        for field, value in state.items():
            assert torch.equal(after["state"][key][field], value), (key, field)
    (pending,) = restored.pending
    assert pending.index == 7 and pending.rollout_s == 1.5
    assert tree_to_json(pending.tree) == tree_to_json(learner.pending[0].tree)


def test_the_model_directory_loads_with_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = _learner(tiny_model_dir, tmp_path)
    learner.train_step([build_random_tree(3, "g-a")])
    model_dir = learner.save(checkpoint=True)
    assert (model_dir / "model.safetensors").exists()
    assert (model_dir.parent / "config.yaml").read_text().strip() == "learner:\n  lr: 0.001"
    loaded = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for name, value in _parameters(learner).items():
        assert torch.equal(dict(loaded.named_parameters())[name], value), name
    assert AutoTokenizer.from_pretrained(str(model_dir)).encode("def f(): pass")


def test_a_failed_write_leaves_the_previous_checkpoint_latest(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    first = learner.save(checkpoint=True).parent
    learner.train_step([build_random_tree(3, "g-a")])
    learner.resolved_config = {"unserialisable": object()}
    with pytest.raises(Exception, match="represent"):
        learner.save(checkpoint=True)
    assert latest_checkpoint(tmp_path) == first
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]


def test_a_hidden_temporary_is_ignored_and_a_second_save_gets_a_serial(tiny_model_dir,
                                                                      tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    first = learner.save(checkpoint=True).parent
    torn = tmp_path / "checkpoints" / ".tmp-step-000005-999"
    torn.mkdir()
    (torn / "state.json").write_text("{")
    second = learner.save(checkpoint=True).parent
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000", "step-000000.1"]
    assert latest_checkpoint(tmp_path) == second != first
    assert load_checkpoint(second, restore_rng=False).state.step == 0


def test_only_the_newest_checkpoints_are_kept(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    for _ in range(4):
        learner.state.step += 1
        learner.save(checkpoint=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-000002", "step-000003", "step-000004"]
