"""The training loop: a step lowers the loss and reaches a real engine as a new weight
version; the staleness bound holds; stop and resume end where an uninterrupted run ends."""

import asyncio
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from undertow.cells.loop import train_alone
from undertow.learner.advantages import group_advantages
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.gateway_link import EngineWeightSink
from undertow.learner.metrics_log import read_metrics
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.train import FinishedGroup, Learner

from .conftest import build_random_tree

pytestmark = pytest.mark.slow


class ScriptedSource:
    """A rollout source at the loop's outer edge: group `index` is the random tree of
    seed `index` whose sampled tokens carry the launch's weight version. Groups in
    `held` are returned only once group `release_after` has been launched."""

    def __init__(self, held=(), release_after=None):
        self.launches, self.ready, self.held = [], [], {}
        self.held_indices, self.release_after = set(held), release_after

    def launch(self, request):
        self.launches.append((request.index, request.weight_version, request.group_id))
        tree = build_random_tree(request.index, request.group_id,
                                 num_sessions=request.group_size)
        for node in tree.nodes.values():
            if node.trainable:
                node.weight_versions = [request.weight_version] * len(node.token_ids)
        group = FinishedGroup(request.index, tree, rollout_s=0.0)
        if request.index in self.held_indices:
            self.held[request.index] = group
        else:
            self.ready.append(group)
        if request.index == self.release_after:
            self.ready.extend(self.held.values())
            self.held.clear()

    def wait(self, timeout_s):
        ready, self.ready = self.ready, []
        return ready


class RecordingSink:
    def __init__(self, stop_at=None, stop=None):
        self.pushes, self.stop_at, self.stop = [], stop_at, stop

    def push(self, model_dir, weight_version):
        assert (Path(model_dir) / "model.safetensors").exists()
        self.pushes.append(weight_version)
        if weight_version == self.stop_at:
            self.stop.set()


def _learner(tiny_model_dir, run_dir, **changes):
    config = TrainConfig(**{"lr": 1e-3, "group_size": 3, "num_steps": 3, **changes})
    return Learner(config, LossConfig(), AdvantageConfig(), tiny_model_dir, run_dir)


def _step_loss(learner, tree):
    advantages = {(tree.group_id, s): a
                  for s, a in group_advantages(tree, learner.advantage_config).items()}
    step = pack_step([tree], advantages, learner.config.max_tokens)
    with torch.no_grad():
        return backward_step(learner.policy, step, learner.loss, backward=False)["loss"]


def test_a_step_lowers_the_loss_and_changes_the_weights(tiny_model_dir, tmp_path):
    learner = _learner(tiny_model_dir, tmp_path)
    tree = build_random_tree(11, "g")
    before = {n: p.detach().clone() for n, p in learner.policy.model.named_parameters()}
    loss_before = _step_loss(learner, tree)
    metrics = learner.train_step([tree])
    assert metrics["loss"] == pytest.approx(loss_before, rel=1e-6)
    assert _step_loss(learner, tree) < loss_before
    changed = [n for n, p in learner.policy.model.named_parameters()
               if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    assert learner.state.step == 1 and metrics["num_trained_tokens"] > 0
    assert metrics["num_unique_tokens"] < metrics["num_flat_tokens"]
    assert 0.0 <= metrics["clip_fraction"] <= 1.0 and metrics["entropy"] > 0


def test_frozen_parameters_keep_their_values_and_get_no_optimizer_state(tiny_untied_model_dir,
                                                                       tmp_path):
    frozen = ("model.embed_tokens", "lm_head")
    learner = _learner(tiny_untied_model_dir, tmp_path, frozen=frozen)
    named = dict(learner.policy.model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    learner.train_step([build_random_tree(11, "g")])
    unchanged = {n for n, p in named.items() if torch.equal(p, before[n])}
    assert unchanged == {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(named[n].grad is None for n in unchanged)
    states = learner.optimizer.state
    assert {id(p) for p in states} == {id(p) for n, p in named.items() if n not in unchanged}
    with pytest.raises(ValueError, match=r"learner\.frozen: 'model\.embed'"):
        _learner(tiny_untied_model_dir, tmp_path / "bad", frozen=("model.embed",))


def test_a_tied_head_is_frozen_by_either_of_its_names(tiny_model_dir, tmp_path):
    # The tiny model ties its head to its embedding, as SmolLM2 does: one parameter,
    # which named_parameters() lists once, as the embedding.
    learner = _learner(tiny_model_dir, tmp_path, frozen=("lm_head",))
    model = learner.policy.model
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.model.embed_tokens.weight.requires_grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(dict(model.named_parameters())) - {"model.embed_tokens.weight"}


def test_the_loop_trains_through_objective_backward_step_and_reports_its_sums(tiny_model_dir,
                                                                             tmp_path):
    """One backward path: the loop's gradient and metrics are `objective.backward_step`'s
    on the same step, the function the elastic run's members call per micro-batch."""
    config = TrainConfig(lr=1e-3, group_size=3, num_steps=1, max_grad_norm=1e9)
    learner = Learner(config, LossConfig(kl_coef=0.1, entropy_coef=0.01), AdvantageConfig(),
                      tiny_model_dir, tmp_path)
    tree = build_random_tree(5, "g")
    advantages = {(tree.group_id, s): a
                  for s, a in group_advantages(tree, learner.advantage_config).items()}
    step = learner.placement.prepare(learner.pack([tree], advantages, config.max_tokens))
    learner.optimizer.zero_grad(set_to_none=True)
    expected = backward_step(learner.policy, step, learner.loss, learner.reference)
    gradients = {n: p.grad.clone() for n, p in learner.policy.model.named_parameters()}
    metrics = learner.train_step([tree])
    for name, parameter in learner.policy.model.named_parameters():
        assert torch.equal(parameter.grad, gradients[name]), name
    num_terms = expected["num_terms"]
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert metrics["kl"] == pytest.approx(expected["behaviour_kl_sum"] / num_terms, rel=1e-6)
    assert metrics["entropy"] == pytest.approx(expected["entropy_sum"] / num_terms, rel=1e-6)
    assert metrics["kl_ref"] == pytest.approx(expected["kl_sum"] / num_terms, rel=1e-6)
    assert metrics["kl"] > 0 and metrics["num_trained_tokens"] == int(num_terms)


def _generate(url, input_ids):
    body = {"input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_new_weights_reach_a_real_engine_as_a_new_version(tiny_model_dir, tmp_path):
    from undertow.gateway.engines.launch import start_engine

    engine = asyncio.run(start_engine("builtin", tiny_model_dir))
    try:
        before = _generate(engine.url, [5, 6, 7, 8])
        learner = _learner(tiny_model_dir, tmp_path, lr=3e-2)
        learner.train_step([build_random_tree(11, "g")])
        EngineWeightSink([engine.url]).push(learner.save(checkpoint=False), 1)
        after = _generate(engine.url, [5, 6, 7, 8])
    finally:
        asyncio.run(engine.stop())
    assert before["meta_info"]["weight_version"] == "0"
    assert after["meta_info"]["weight_version"] == "1"
    assert (after["meta_info"]["output_token_logprobs"]
            != before["meta_info"]["output_token_logprobs"])


def test_synchronous_loop_launches_each_group_on_the_newest_weights(tiny_model_dir, tmp_path):
    source, sink = ScriptedSource(), RecordingSink()
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0)
    assert train_alone(learner, source, sink) == "done"
    assert [(i, v) for i, v, _ in source.launches] == [(0, 0), (1, 1), (2, 2)]
    assert sink.pushes == [1, 2, 3]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["staleness_max"] == 0 for r in records)


def test_staleness_bound_limits_launches_and_drops_a_late_group(tiny_model_dir, tmp_path):
    source = ScriptedSource(held={0}, release_after=3)
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=1, num_steps=4)
    assert train_alone(learner, source, RecordingSink()) == "done"
    records = read_metrics(tmp_path)
    assert sum(r["num_dropped_groups"] for r in records) == 1
    assert all(r["staleness_max"] <= 1 for r in records)
    assert 0 in learner.state.consumed
    # A launch at version v is for a step trained by weights at most v + 1.
    trained_order = [i for i in learner.state.consumed if i != 0]
    for step, index in enumerate(trained_order):
        version = next(v for i, v, _ in source.launches if i == index)
        assert step - version <= 1


def test_stop_and_resume_ends_with_the_weights_of_an_uninterrupted_run(tiny_model_dir,
                                                                       tmp_path):
    straight = _learner(tiny_model_dir, tmp_path / "straight", max_staleness=1)
    train_alone(straight, ScriptedSource(), RecordingSink())

    stop = threading.Event()
    first = _learner(tiny_model_dir, tmp_path / "resumed", max_staleness=1)
    sink = RecordingSink(stop_at=1, stop=stop)
    assert train_alone(first, ScriptedSource(), sink, stop) == "stopped"
    resumed = Learner.restore(first.config, first.loss, first.advantage_config,
                              tiny_model_dir, tmp_path / "resumed")
    assert resumed.state.step == 1 and resumed.state.num_resumes == 1
    source = ScriptedSource()
    assert train_alone(resumed, source, RecordingSink()) == "done"
    assert all(group_id.endswith("-r1") for _, _, group_id in source.launches)
    for name, value in straight.policy.model.named_parameters():
        assert torch.equal(dict(resumed.policy.model.named_parameters())[name], value), name
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3]


class SilentSource:
    """A rollout source whose groups never finish."""

    def __init__(self):
        self.launches = []

    def launch(self, request):
        self.launches.append(request.index)

    def wait(self, timeout_s):
        time.sleep(min(timeout_s, 0.01))
        return []


def test_no_group_finishing_within_the_timeout_stops_the_run(tiny_model_dir, tmp_path):
    source = SilentSource()
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0, group_timeout_s=0.2)
    with pytest.raises(TimeoutError, match=r"learner\.group_timeout_s=0\.2; are the rollouts"):
        train_alone(learner, source, RecordingSink())
    assert source.launches == [0] and read_metrics(tmp_path) == []
