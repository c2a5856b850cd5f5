"""QwenGyre's value of a session cut off by its time limit, read from its group's tree: the
mean reward of the finished sessions that went furthest the same way. The learner enters a
cut session with it (`advantages.timeout_reward="tree_value"`); the rollout runner can close
one with it (`timeout_value="tree_estimate"`, adapters/tree_value.py).

"The same way" is measured in tokens, not nodes: the tree gives each session's sampled
tokens nodes of their own (they carry that session's logprobs and weight versions), so two
sessions that sampled the same command share no node below the prompt. Paths are compared
token by token instead, which is what a trie of the group's token sequences would share.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from undertow.gateway.trees.tree import Tree


@dataclass(frozen=True)
class TreeValue:
    """The mean reward of the `num_sessions` finished sessions that share the longest token
    prefix, `num_shared_tokens` long, with a path of the cut session."""

    value: float
    num_shared_tokens: int
    num_sessions: int


def tree_value(tree: Tree, session_id: str,
               finished_rewards: Mapping[str, float]) -> TreeValue | None:
    """The value of `session_id` from the sessions in `finished_rewards` (those that ended
    by themselves, with their rewards); None when it is not in the tree or no finished
    session shares a token with it."""
    if session_id not in tree.sessions:
        return None
    own = _paths(tree, session_id)
    shared = {}
    for other in finished_rewards:
        if other != session_id and other in tree.sessions:
            theirs = _paths(tree, other)
            # commonprefix compares any sequences item by item: here token lists, not paths.
            shared[other] = max((len(os.path.commonprefix([a, b]))  # noqa: RUF071
                                 for a in own for b in theirs), default=0)
    longest = max(shared.values(), default=0)
    if longest == 0:
        return None
    peers = [finished_rewards[other] for other, length in shared.items() if length == longest]
    return TreeValue(sum(peers) / len(peers), longest, len(peers))


def _paths(tree: Tree, session_id: str) -> list[list[int]]:
    return [tree.path_token_ids(leaf) for leaf in tree.sessions[session_id].leaves]
