"""Packing invariants on random trees with branches, across micro-batch budgets."""

import pytest
import torch

from tests.learner.random_trees import build_random_tree
from undertow.gateway.trees.tree import Tree
from undertow.learner.errors import EmptyStepError
from undertow.learner.packing import pack_step

BUDGETS = [10**6, 48, 16, 3]


def _advantages(trees, value=1.0):
    return {(t.group_id, s): value for t in trees for s in t.sessions}


def _token_origins(step, micro_batch):
    """(tree index, node ID, offset) of each packed token."""
    origins = []
    for key in micro_batch.unit_keys:
        unit = step.units[key]
        origins += [(unit.tree_index, unit.node_id, o) for o in range(unit.start, unit.end)]
    return origins


def _depth(tree, node_id, offset):
    return sum(len(tree.nodes[n].token_ids) for n in tree.path(node_id)[:-1]) + offset


@pytest.mark.parametrize("budget", BUDGETS)
def test_positions_mask_and_terms_follow_the_tree(random_trees, budget):
    step = pack_step(random_trees, _advantages(random_trees), budget)
    for mb in step.micro_batches:
        origins = _token_origins(step, mb)
        ancestry = {}
        for t, n, o in origins:
            tree = random_trees[t]
            assert mb.token_ids[len(ancestry)] == tree.nodes[n].token_ids[o]
            assert mb.position_ids[len(ancestry)] == _depth(tree, n, o)
            ancestry[(t, n, o)] = set(tree.path(n))
        allowed = mb.allowed()
        for i, (ti, ni, oi) in enumerate(origins):
            for j, (tj, nj, oj) in enumerate(origins):
                expected = ti == tj and nj in ancestry[(ti, ni, oi)] and (nj != ni or oj <= oi)
                assert bool(allowed[i, j]) == expected, (i, j)
        for term, token, predictor in zip(mb.term_ids.tolist(), mb.term_token_index.tolist(),
                                          mb.term_predictor_index.tolist(), strict=True):
            assert origins[token] == step.term_origin[term]
            t, n, o = origins[token]
            path = [(n2, o2) for n2 in random_trees[t].path(n)
                    for o2 in range(len(random_trees[t].nodes[n2].token_ids))]
            assert (origins[predictor][1:]) == path[path.index((n, o)) - 1]


@pytest.mark.parametrize("budget", BUDGETS)
def test_every_trainable_token_is_one_term_trained_once(random_trees, budget):
    step = pack_step(random_trees, _advantages(random_trees), budget)
    expected = {(t, n, o) for t, tree in enumerate(random_trees)
                for n, node in tree.nodes.items() if node.sampled_by is not None
                for o in range(len(node.token_ids)) if _depth(tree, n, o) > 0}
    assert sorted(step.term_origin) == sorted(expected)
    trained = torch.cat([mb.term_ids for mb in step.micro_batches]).tolist()
    assert sorted(trained) == list(range(step.num_terms))
    for term, (t, n, _) in enumerate(step.term_origin):
        group, session = step.session_keys[step.term_session[term]]
        assert group == random_trees[t].group_id
        assert session == random_trees[t].nodes[n].sampled_by


@pytest.mark.parametrize("budget", BUDGETS)
def test_micro_batches_respect_the_budget_and_hold_their_context(random_trees, budget):
    step = pack_step(random_trees, _advantages(random_trees), budget)
    for mb in step.micro_batches:
        keys = set(mb.unit_keys)
        for key in keys:
            parent = step.units[key].parent
            assert parent is None or parent in keys
        if mb.num_tokens > budget:
            # Only one unit plus its full context may exceed the budget.
            deepest = max(mb.unit_keys, key=lambda k: step.units[k].depth)
            unit = step.units[deepest]
            assert mb.num_tokens == unit.depth + unit.num_tokens
            assert mb.num_trained_tokens == unit.num_tokens


def test_one_micro_batch_holds_each_token_once(random_trees):
    step = pack_step(random_trees, _advantages(random_trees), 10**6)
    assert len(step.micro_batches) == 1
    assert step.num_packed_tokens == sum(t.num_unique_tokens for t in random_trees)


def test_subtrees_stay_together_when_they_fit():
    tree = build_random_tree(5, num_sessions=4, num_turns=3, rewrite_prob=0.0)
    step = pack_step([tree], _advantages([tree]), 10**6)
    root_unit = step.units[0]
    subtree_sizes = []
    for session_id in tree.sessions:
        nodes = {n for leaf in tree.sessions[session_id].leaves for n in tree.path(leaf)}
        subtree_sizes.append(sum(len(tree.nodes[n].token_ids) for n in nodes)
                             - root_unit.num_tokens)
    budget = root_unit.num_tokens + max(subtree_sizes)
    split = pack_step([tree], _advantages([tree]), budget)
    assert len(split.micro_batches) <= len(tree.sessions)
    for mb in split.micro_batches:
        sessions = {split.term_session[t].item() for t in mb.term_ids}
        assert sessions, "a micro-batch trains something"
    # Each session's terms are trained in a single micro-batch: siblings were not split.
    where = {}
    for index, mb in enumerate(split.micro_batches):
        for term in mb.term_ids.tolist():
            where.setdefault(split.term_session[term].item(), set()).add(index)
    assert all(len(indices) == 1 for indices in where.values())


def test_only_named_sessions_are_trained(random_trees):
    tree = random_trees[0]
    step = pack_step([tree], {(tree.group_id, "s1"): 0.5}, 10**6)
    assert step.session_keys == [(tree.group_id, "s1")]
    assert torch.all(step.advantages == 0.5)
    nodes_of_s1 = {n for leaf in tree.sessions["s1"].leaves for n in tree.path(leaf)}
    assert {u.node_id for u in step.units} == nodes_of_s1


def test_max_paths_keeps_the_most_recent_paths(random_trees):
    tree = random_trees[1]
    step = pack_step([tree], _advantages([tree]), 10**6, max_paths_per_session=1)
    for term, (_, node_id, _) in enumerate(step.term_origin):
        session = step.session_keys[step.term_session[term]][1]
        assert node_id in tree.path(tree.sessions[session].leaves[-1])
        assert step.term_path[term] == 0


def test_a_step_without_trainable_tokens_names_its_sessions():
    tree = Tree("g")
    tree.add_call("c0", "alpha", [1, 2, 3], [], [], [])
    tree.add_call("c1", "beta", [1, 2, 4], [], [], [])
    with pytest.raises(EmptyStepError, match=r"g/alpha.*g/beta"):
        pack_step([tree], {("g", "alpha"): 1.0, ("g", "beta"): -1.0}, 100)


def test_a_first_token_is_never_a_term():
    tree = Tree("g")
    tree.add_call("c0", "alpha", [], [7], [-1.0], [0])
    with pytest.raises(EmptyStepError, match="g/alpha"):
        pack_step([tree], {("g", "alpha"): 1.0}, 100)


def test_each_term_carries_the_version_gap_of_its_own_token():
    # One session, three calls sampled by versions 0, 2 and 3 (the last call's versions
    # change mid-call: a resume after a weight update), and one token whose version the
    # engine did not report (-1); the step trains version 3.
    tree = Tree("g")
    tree.add_call("c0", "s", [1, 2], [10, 11], [-1.0, -1.1], [0, 0])
    tree.add_call("c1", "s", [1, 2, 10, 11, 5], [12, 13, 14], [-1.2] * 3, [2, -1, 2])
    tree.add_call("c2", "s", [1, 2, 10, 11, 5, 12, 13, 14, 6], [15, 16], [-1.3] * 2, [2, 3])
    advantages = {("g", "s"): 1.0}
    for budget in (10**6, 3):
        step = pack_step([tree], advantages, budget, weight_version=3)
        by_token = {tree.nodes[n].token_ids[o]: int(step.term_version_gap[term])
                    for term, (_, n, o) in enumerate(step.term_origin)}
        assert by_token == {10: 3, 11: 3, 12: 1, 13: 0, 14: 1, 15: 1, 16: 0}
    # A version newer than the weights trained (never sampled by this run) counts as 0,
    # and without a weight version every gap is 0.
    assert pack_step([tree], advantages, 100, weight_version=1).term_version_gap.tolist() \
        == [1, 1, 0, 0, 0, 0, 0]
    assert pack_step([tree], advantages, 100).term_version_gap.tolist() == [0] * 7
