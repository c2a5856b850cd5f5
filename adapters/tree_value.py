"""QwenGyre's value estimate for a session cut off by its time limit, from its group's tree
as the gateway's admin API returns it (docs/adapters.md#the-rollout-runner); the rule is
`undertow.gateway.trees.tree_value`'s, the one the learner uses.
"""

from collections.abc import Mapping
from typing import Any

from undertow.gateway.trees.tree import tree_from_json
from undertow.gateway.trees.tree_value import TreeValue, tree_value

__all__ = ["TreeValue", "estimate_tree_value"]


def estimate_tree_value(tree: Mapping[str, Any], session_id: str,
                        finished_rewards: Mapping[str, float]) -> TreeValue | None:
    """The estimate for `session_id` from the sessions in `finished_rewards` (those that
    ended by themselves, with their rewards): the mean reward of those whose paths share
    the longest token prefix with its paths; None when none shares a token with it. `tree`
    is the group tree in `tree_to_json`'s form."""
    return tree_value(tree_from_json(dict(tree)), session_id, finished_rewards)
