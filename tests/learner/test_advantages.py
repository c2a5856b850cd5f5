"""Advantages by hand: group-relative with std or mean-only, and timed-out sessions."""

import math

import pytest

from undertow.gateway.trees.tree import Tree
from undertow.learner.advantages import (
    group_advantages,
    infra_failures,
    is_uniform,
    session_rewards,
    valid_sessions,
)
from undertow.learner.config import AdvantageConfig


def _group(rewards: dict[str, float], prompts: dict[str, list[int]] | None = None,
           timed_out: tuple[str, ...] = ()) -> Tree:
    tree = Tree("g")
    for index, (session_id, reward) in enumerate(rewards.items()):
        prompt = (prompts or {}).get(session_id, [1, 2, 3])
        tree.add_call(f"c{index}", session_id, prompt, [50 + index], [-1.0], [0])
        tree.close_session(session_id, reward, {"timed_out": session_id in timed_out})
    return tree


def test_group_relative_with_population_std():
    tree = _group({"a": 1.0, "b": 0.0, "c": 0.5})
    std = math.sqrt((0.25 + 0.25 + 0.0) / 3)
    advantages = group_advantages(tree, AdvantageConfig(eps=1e-6))
    assert advantages == pytest.approx({"a": 0.5 / (std + 1e-6), "b": -0.5 / (std + 1e-6),
                                        "c": 0.0})


def test_mean_only():
    tree = _group({"a": 1.0, "b": 0.0, "c": 0.5})
    assert group_advantages(tree, AdvantageConfig(scale="none")) == pytest.approx(
        {"a": 0.5, "b": -0.5, "c": 0.0})


def test_identical_rewards_give_zero_advantage():
    tree = _group({"a": 1.0, "b": 1.0})
    assert group_advantages(tree, AdvantageConfig()) == {"a": 0.0, "b": 0.0}


def test_open_sessions_are_left_out():
    tree = _group({"a": 1.0, "b": 0.0})
    tree.add_call("open", "c", [1, 2, 3], [9], [-1.0], [0])
    assert set(group_advantages(tree, AdvantageConfig())) == {"a", "b"}


def _timeout_tree() -> Tree:
    # c timed out; it shares [1, 2, 3, 4, 5] with b but only [1, 2, 3] with a.
    prompts = {"a": [1, 2, 3, 9], "b": [1, 2, 3, 4, 5, 6], "c": [1, 2, 3, 4, 5, 7]}
    return _group({"a": 1.0, "b": 0.0, "c": 0.3}, prompts, timed_out=("c",))


def test_timed_out_session_keeps_its_partial_credit():
    rewards = session_rewards(_timeout_tree(), AdvantageConfig(timeout_reward="partial_credit"))
    assert rewards == {"a": 1.0, "b": 0.0, "c": 0.3}


def test_timed_out_session_takes_the_value_of_its_deepest_shared_node():
    config = AdvantageConfig(timeout_reward="tree_value", scale="none")
    assert session_rewards(_timeout_tree(), config) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert group_advantages(_timeout_tree(), config) == pytest.approx(
        {"a": 2 / 3, "b": -1 / 3, "c": -1 / 3})


def test_dropped_timed_out_session_has_no_advantage_and_does_not_move_the_mean():
    config = AdvantageConfig(timeout_reward="drop", scale="none")
    assert session_rewards(_timeout_tree(), config) == {"a": 1.0, "b": 0.0}
    assert group_advantages(_timeout_tree(), config) == pytest.approx({"a": 0.5, "b": -0.5})


def test_tree_value_averages_equally_deep_peers():
    prompts = {"a": [1, 2, 3, 9], "b": [1, 2, 3, 8], "c": [1, 2, 3, 7]}
    tree = _group({"a": 1.0, "b": 0.0, "c": 0.3}, prompts, timed_out=("c",))
    rewards = session_rewards(tree, AdvantageConfig(timeout_reward="tree_value"))
    assert rewards["c"] == pytest.approx(0.5)


def test_tree_value_follows_sampled_tokens_that_two_sessions_share():
    # Each session's sampled tokens are nodes of its own, so below the prompt no two
    # sessions share a node: c (cut) sampled the same first command as a and then was
    # stopped; b sampled another. By tokens c went a's way, so it takes a's reward.
    tree = Tree("g")
    prompt, first_output = [1, 2, 3], [40, 41]
    for session_id, command, second in (("a", [7, 8], [60]), ("b", [9], [61]),
                                        ("c", [7, 8], [62])):
        tree.add_call(f"{session_id}0", session_id, prompt, command, [-1.0] * len(command),
                      [0] * len(command))
        tree.add_call(f"{session_id}1", session_id, prompt + command + first_output, second,
                      [-1.0], [0])
    tree.close_session("a", 1.0, {})
    tree.close_session("b", 0.0, {})
    tree.close_session("c", 0.0, {"cause": "timeout"})
    assert session_rewards(tree, AdvantageConfig(timeout_reward="tree_value"))["c"] == 1.0


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="scale"):
        AdvantageConfig(scale="rank")
    with pytest.raises(ValueError, match="timeout_reward"):
        AdvantageConfig(timeout_reward="zero")


def test_sessions_undertow_failed_have_no_advantage_and_do_not_move_the_mean():
    tree = _group({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 0.0})
    tree.close_session("c", 0.0, {"cause": "error:grade", "infra_failure": True})
    tree.close_session("d", 0.0, {"cause": "error:sandbox"})   # older metas: by cause
    tree.close_session("e", 0.0, {"cause": "interrupted"})
    assert valid_sessions(tree) == {"a": 1.0, "b": 0.0}
    assert infra_failures(tree) == {"error:grade": 1, "error:sandbox": 1, "interrupted": 1}
    # Mean 0.5 over a and b only: with the failures counted as 0 it would be 0.2.
    assert group_advantages(tree, AdvantageConfig(scale="none")) == pytest.approx(
        {"a": 0.5, "b": -0.5})


def test_scaffold_outcomes_stay_in_the_group():
    tree = _group({"a": 1.0, "b": 0.0, "c": 0.0})
    tree.close_session("b", 0.0, {"cause": "crashed", "infra_failure": False})
    tree.close_session("c", 0.0, {"cause": "output_flood"})
    assert set(group_advantages(tree, AdvantageConfig())) == {"a", "b", "c"}
    assert infra_failures(tree) == {}


def test_uniform_groups_and_the_filter_config():
    assert is_uniform({"a": 1.0, "b": 1.0}) and not is_uniform({"a": 1.0, "b": 0.0})
    assert AdvantageConfig(filter_uniform_groups=True, max_extra_groups=0).max_extra_groups == 0
    with pytest.raises(ValueError, match="max_extra_groups"):
        AdvantageConfig(max_extra_groups=-1)
