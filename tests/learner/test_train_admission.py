"""Which finished groups the training loop trains: a step with no trainable token is not
trained and more groups come; uniform groups are dropped up to the bound of extra groups;
sessions Undertow failed are counted and never trained; a run of groups whose every
session failed, or whose sessions the time limit cut so that none could train
(`timeout_reward="drop"`), stops with one RunFailedError naming the cause."""

import pytest

from tests.learner.random_trees import build_random_tree
from undertow.cells.loop import train_alone
from undertow.gateway.trees.tree import Tree
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.errors import RunFailedError
from undertow.learner.metrics_log import format_step, read_metrics
from undertow.learner.train import FinishedGroup, Learner

pytestmark = pytest.mark.slow


class PlannedSource:
    """A rollout source at the loop's outer edge: launch `index` finishes at once with
    the group `plan(index, group_id)` returns, sampled by the launch's weight version."""

    def __init__(self, plan):
        self.plan, self.ready, self.launches = plan, [], []

    def launch(self, request):
        self.launches.append(request.index)
        group = self.plan(request.index, request.group_id)
        for node in group.tree.nodes.values():   # sampled by the weights of the launch
            if node.trainable:
                node.weight_versions = [request.weight_version] * len(node.token_ids)
        self.ready.append(group)

    def wait(self, timeout_s):
        ready, self.ready = self.ready, []
        return ready


class NullSink:
    def push(self, model_dir, weight_version):
        return None


def _learner(tiny_model_dir, run_dir, advantages=None, **changes):
    config = TrainConfig(**{"lr": 1e-3, "group_size": 3, "num_steps": 2, **changes})
    return Learner(config, LossConfig(), advantages or AdvantageConfig(), tiny_model_dir,
                   run_dir)


def _normal(index, group_id):
    tree = build_random_tree(index, group_id)
    for number, session_id in enumerate(tree.sessions):   # mixed rewards
        tree.close_session(session_id, float(number == 0))
    return FinishedGroup(index, tree)


def _no_calls(index, group_id):
    tree = Tree(group_id)
    for number in range(3):
        tree.close_session(f"s{number}", float(number == 0), {"cause": "exited"})
    return FinishedGroup(index, tree)


def _failed(index, group_id, num_valid=0):
    group = _normal(index, group_id)
    for number, session_id in enumerate(group.tree.sessions):
        if number >= num_valid:
            group.tree.close_session(session_id, 0.0, {"cause": "error:sandbox",
                                                       "infra_failure": True})
    group.error = "SandboxError: the daemon refused the container"
    return group


def test_a_step_with_nothing_trainable_is_not_trained_and_more_groups_come(
        tiny_model_dir, tmp_path, capsys):
    source = PlannedSource(lambda i, g: _no_calls(i, g) if i == 0 else _normal(i, g))
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0)
    assert train_alone(learner, source, NullSink()) == "done"
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["num_dropped_invalid"] == 1 and source.launches == [0, 1, 2]
    assert "no trainable token" not in capsys.readouterr().out   # not printed: logged
    [line] = (tmp_path / "train.log").read_text().splitlines()
    assert line.endswith("step 1: dropped group g000000-r0: not trained: no trainable token "
                         "in its sessions")


def test_uniform_groups_are_dropped_up_to_the_bound(tiny_model_dir, tmp_path):
    def plan(index, group_id):
        group = _normal(index, group_id)
        if index < 3:
            for session_id in group.tree.sessions:
                group.tree.close_session(session_id, 1.0)
        return group

    source = PlannedSource(plan)
    advantages = AdvantageConfig(filter_uniform_groups=True, max_extra_groups=2)
    learner = _learner(tiny_model_dir, tmp_path, advantages, max_staleness=0, num_steps=1)
    assert train_alone(learner, source, NullSink()) == "done"
    (record,) = read_metrics(tmp_path)
    # Groups 0 and 1 dropped (the bound: 2 extra), group 2 trained although uniform.
    assert record["num_dropped_uniform"] == 2 and source.launches == [0, 1, 2]
    assert record["reward_mean"] == 1.0 and record["reward_std"] == 0.0
    # The one group trained is uniform: the step says it learned nothing.
    assert record["num_uniform_groups"] == record["num_groups"] == 1
    assert format_step(record).endswith("every group uniform: nothing to learn")


def test_a_step_counts_its_uniform_groups(tiny_model_dir, tmp_path):
    def plan(index, group_id):
        group = _normal(index, group_id)
        if index == 1:
            for session_id in group.tree.sessions:
                group.tree.close_session(session_id, 0.0)
        return group

    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0, num_steps=1,
                       groups_per_step=2)
    assert train_alone(learner, PlannedSource(plan), NullSink()) == "done"
    (record,) = read_metrics(tmp_path)
    assert (record["num_uniform_groups"], record["num_groups"]) == (1, 2)
    assert record["grad_norm"] > 0 and "uniform:" not in format_step(record)


def test_failed_sessions_are_counted_and_never_trained(tiny_model_dir, tmp_path):
    source = PlannedSource(lambda i, g: _failed(i, g, num_valid=2))
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0)
    assert train_alone(learner, source, NullSink()) == "done"
    records = read_metrics(tmp_path)
    assert all(r["num_sessions"] == 2 for r in records)   # of 3: only the valid ones
    assert all(r["infra_failures"] == {"error:sandbox": 1} for r in records)
    assert all(r["num_infra_failures"] == 1 for r in records)


def test_groups_left_with_one_valid_session_are_replaced(tiny_model_dir, tmp_path):
    source = PlannedSource(lambda i, g: _failed(i, g, num_valid=1) if i % 2 == 0
                           else _normal(i, g))
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0)
    assert train_alone(learner, source, NullSink()) == "done"
    records = read_metrics(tmp_path)
    assert [r["num_dropped_invalid"] for r in records] == [1, 1]
    assert source.launches == [0, 1, 2, 3]


def test_groups_whose_every_session_failed_stop_the_run_with_one_error(tiny_model_dir,
                                                                        tmp_path):
    source = PlannedSource(_failed)
    learner = _learner(tiny_model_dir, tmp_path, max_staleness=0, max_failed_groups=3)
    with pytest.raises(RunFailedError, match=r"the last 3 groups.*every session failed with "
                       r"error:sandbox.*the daemon refused the container"):
        train_alone(learner, source, NullSink())
    assert source.launches == [0, 1, 2] and read_metrics(tmp_path) == []


@pytest.mark.parametrize("timeout_reward, dropped", [("partial_credit", 0), ("drop", 1)])
def test_the_uniform_filter_sees_rewards_as_advantages_do(tiny_model_dir, tmp_path,
                                                          timeout_reward, dropped):
    def plan(index, group_id):   # group 0: a cut session's credit is its only spread
        group = _normal(index, group_id)
        if index == 0:
            for number, session_id in enumerate(group.tree.sessions):
                group.tree.close_session(session_id, 0.5 if number == 0 else 0.0,
                                         {"timed_out": number == 0})
        return group

    advantages = AdvantageConfig(filter_uniform_groups=True, timeout_reward=timeout_reward)
    source = PlannedSource(plan)
    learner = _learner(tiny_model_dir, tmp_path, advantages, max_staleness=0, num_steps=1)
    assert train_alone(learner, source, NullSink()) == "done"
    (record,) = read_metrics(tmp_path)
    assert record["num_dropped_uniform"] == dropped
    assert source.launches == list(range(1 + dropped))
    assert record["num_uniform_groups"] == 0
    assert record["num_cut_sessions"] == 1 - dropped   # group 0's, where it trained


def _cut(index, group_id, num_finished=1):
    group = _normal(index, group_id)
    for number, session_id in enumerate(group.tree.sessions):
        if number >= num_finished:
            group.tree.close_session(session_id, 1.0, {"cause": "timeout"})
    return group


def test_groups_the_time_limit_left_too_few_to_train_are_replaced(tiny_model_dir, tmp_path):
    source = PlannedSource(lambda i, g: _cut(i, g) if i % 2 == 0 else _normal(i, g))
    learner = _learner(tiny_model_dir, tmp_path, AdvantageConfig(timeout_reward="drop"),
                       max_staleness=0, max_failed_groups=2)
    assert train_alone(learner, source, NullSink()) == "done"
    records = read_metrics(tmp_path)
    assert [r["num_dropped_invalid"] for r in records] == [1, 1]
    assert source.launches == [0, 1, 2, 3]


@pytest.mark.parametrize("timeout_reward", ["drop", "tree_value"])
def test_groups_cut_by_the_time_limit_stop_a_run_that_drops_them(tiny_model_dir, tmp_path,
                                                                 timeout_reward):
    source = PlannedSource(_cut)
    learner = _learner(tiny_model_dir, tmp_path, AdvantageConfig(timeout_reward=timeout_reward),
                       max_staleness=0, max_failed_groups=3)
    if timeout_reward == "tree_value":   # the cut sessions enter: every group trains
        assert train_alone(learner, source, NullSink()) == "done"
        assert source.launches == [0, 1]
        return
    with pytest.raises(RunFailedError, match=r"the last 3 groups had too few sessions to "
                       r"train: their time limit cut 6 of their 9 sessions.*"
                       r"rollout.timeout_s"):
        train_alone(learner, source, NullSink())
    assert source.launches == [0, 1, 2] and read_metrics(tmp_path) == []
