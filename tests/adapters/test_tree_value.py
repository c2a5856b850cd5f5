"""QwenGyre's tree-value estimate, on hand-built trees in the admin API's JSON form."""

from undertow.adapters.tree_value import estimate_tree_value


def tree(edges: dict[int, int | None], leaves: dict[str, list[int]]) -> dict:
    return {"nodes": [{"id": node, "parent": parent} for node, parent in edges.items()],
            "sessions": {sid: {"leaves": ids} for sid, ids in leaves.items()}}


# 0 (prompt) -> 1 -> 2 -> 3 (cut-off session "t" ends at 3)
#                     \-> 4 (finished "a")
#               \-> 5 (finished "b")
EDGES = {0: None, 1: 0, 2: 1, 3: 2, 4: 2, 5: 1}


def test_estimate_uses_the_deepest_shared_node():
    group = tree(EDGES, {"t": [3], "a": [4], "b": [5]})
    estimate = estimate_tree_value(group, "t", {"a": 1.0, "b": 0.0})
    assert (estimate.node_id, estimate.depth, estimate.num_sessions) == (2, 3, 1)
    assert estimate.value == 1.0


def test_estimate_averages_the_sessions_sharing_the_node():
    group = tree(EDGES, {"t": [2], "a": [4], "b": [3]})
    estimate = estimate_tree_value(group, "t", {"a": 1.0, "b": 0.0})
    assert estimate.node_id == 2 and estimate.value == 0.5 and estimate.num_sessions == 2


def test_sessions_that_did_not_finish_are_ignored():
    group = tree(EDGES, {"t": [3], "a": [4], "b": [5]})
    estimate = estimate_tree_value(group, "t", {"b": 0.25})
    assert estimate.node_id == 1 and estimate.value == 0.25


def test_no_shared_node_gives_no_estimate():
    group = tree({0: None, 1: None}, {"t": [0], "a": [1]})
    assert estimate_tree_value(group, "t", {"a": 1.0}) is None
    assert estimate_tree_value(group, "missing", {"a": 1.0}) is None
