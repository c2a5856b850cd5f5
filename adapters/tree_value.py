"""QwenGyre's value estimate for a session cut off by its time limit.

A timed-out session has no outcome of its own. Its group's tree tells how far it got:
the deepest node on its paths that finished sessions of the same group also went
through. The finished sessions that share that node started the same way, so the
mean of their rewards estimates what the cut-off session would have earned. The
estimate uses the group tree as the gateway's admin API returns it (`tree_to_json` in
`gateway/trees/tree.py`: `nodes` with `id` and `parent`, `sessions` with `leaves`).
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
    path, node = [], leaf
    while node in parents:
        path.append(node)
        node = parents[node]
    return path[::-1]


def estimate_tree_value(tree: Mapping[str, Any], session_id: str,
                        finished_rewards: Mapping[str, float]) -> TreeValue | None:
    """The estimate for `session_id` from the sessions in `finished_rewards` (those that
    ended by themselves, with their rewards); None when no finished session shares any
    node with it."""
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
