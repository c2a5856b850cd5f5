"""QwenGyre's value estimate for a session cut off by its time limit, from its group's tree
(docs/adapters.md#the-rollout-runner).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TreeValue:
    """The estimate: mean reward of `num_sessions` finished sessions that share `node_id`,
    found `depth` nodes below the root."""

    value: float
    node_id: int
    depth: int
    num_sessions: int


def _path(parents: Mapping[int, int | None], leaf: int) -> list[int]:
    path: list[int] = []
    node: int | None = leaf
    while node is not None and node in parents:
        path.append(node)
        node = parents[node]
    return path[::-1]


def estimate_tree_value(tree: Mapping[str, Any], session_id: str,
                        finished_rewards: Mapping[str, float]) -> TreeValue | None:
    """The estimate for `session_id` from the sessions in `finished_rewards` (those that
    ended by themselves, with their rewards): the mean reward of those that share the
    deepest node on its paths; None when none shares any node with it. `tree` is the group
    tree as the gateway's admin API returns it (`tree_to_json`)."""
    parents = {node["id"]: node["parent"] for node in tree["nodes"]}
    sessions = tree["sessions"]
    if session_id not in sessions:
        return None
    others: dict[str, set[int]] = {}
    for other in finished_rewards:
        if other != session_id and other in sessions:
            others[other] = {n for leaf in sessions[other]["leaves"] for n in _path(parents, leaf)}
    best: TreeValue | None = None
    for leaf in sessions[session_id]["leaves"]:
        path = _path(parents, leaf)
        for depth in range(len(path), 0, -1):
            node = path[depth - 1]
            sharing = [other for other, nodes in others.items() if node in nodes]
            if sharing:
                if best is None or depth > best.depth:
                    value = sum(finished_rewards[s] for s in sharing) / len(sharing)
                    best = TreeValue(value, node, depth, len(sharing))
                break
    return best
