"""QwenGyre's tree-value estimate, on group trees built call by call and given in the admin
API's JSON form (`tree_to_json`)."""

from undertow.adapters.tree_value import estimate_tree_value
from undertow.gateway.trees.tree import Tree, tree_to_json

PROMPT = [1, 2, 3]


def group(sessions: dict[str, list[list[int]]]) -> dict:
    """Each session's calls as sampled commands; every command's output is [40 + turn]."""
    tree = Tree("g")
    for session_id, commands in sessions.items():
        history = list(PROMPT)
        for turn, command in enumerate(commands):
            tree.add_call(f"{session_id}{turn}", session_id, history, command,
                          [-1.0] * len(command), [0] * len(command))
            history = history + command + [40 + turn]
    return tree_to_json(tree)


def test_estimate_follows_the_longest_shared_token_prefix():
    # t was cut after the two commands a also ran; b's second command differs.
    tree = group({"t": [[7, 8], [9]], "a": [[7, 8], [9], [5]], "b": [[7, 8], [6]]})
    estimate = estimate_tree_value(tree, "t", {"a": 1.0, "b": 0.0})
    assert (estimate.value, estimate.num_sessions) == (1.0, 1)
    assert estimate.num_shared_tokens == len(PROMPT) + 2 + 1 + 1


def test_estimate_averages_the_sessions_sharing_as_much():
    tree = group({"t": [[7, 8], [9]], "a": [[7, 8], [5]], "b": [[7, 8], [6]]})
    estimate = estimate_tree_value(tree, "t", {"a": 1.0, "b": 0.0})
    assert (estimate.value, estimate.num_sessions) == (0.5, 2)


def test_sessions_that_did_not_finish_are_ignored():
    tree = group({"t": [[7, 8], [9]], "a": [[7, 8], [9]], "b": [[6]]})
    estimate = estimate_tree_value(tree, "t", {"b": 0.25})
    assert estimate.value == 0.25 and estimate.num_shared_tokens == len(PROMPT)


def test_no_shared_token_gives_no_estimate():
    tree = Tree("g")
    tree.add_call("t0", "t", [1, 2, 3], [7], [-1.0], [0])
    tree.add_call("a0", "a", [5, 6], [7], [-1.0], [0])
    assert estimate_tree_value(tree_to_json(tree), "t", {"a": 1.0}) is None
    assert estimate_tree_value(tree_to_json(tree), "missing", {"a": 1.0}) is None
