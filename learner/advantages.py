"""Advantages: one number per session of a group, from the group's rewards. The learner
calls `group_advantages(tree, config)` per finished group (docs/design.md, "From `undertow
train` to the loss", step 8); only sessions with an outcome the policy earned enter a group
(`valid_sessions`), so a session Undertow failed never reaches the loss.
"""

from __future__ import annotations

import math

from undertow.gateway.trees.tree import Tree
from undertow.gateway.trees.tree_value import tree_value
from undertow.learner.config import AdvantageConfig

# Causes of sessions stopped or failed by Undertow, not by the policy (with `error:*`).
INFRA_CAUSES = ("killed", "interrupted", "pending")


def is_timed_out(tree: Tree, session_id: str) -> bool:
    meta = tree.sessions[session_id].meta
    return bool(meta.get("timed_out", False)) or meta.get("cause") == "timeout"


def is_infra_failure(meta: dict) -> bool:
    """Whether a session's close meta says Undertow, not the policy, ended it (or
    stopped it): `infra_failure: true`, or a cause `error:<stage>`, `killed` or
    `interrupted` (`adapters/summary.py`)."""
    cause = str(meta.get("cause", ""))
    return bool(meta.get("infra_failure")) or cause.startswith("error:") or \
        cause in INFRA_CAUSES


def valid_sessions(tree: Tree) -> dict[str, float]:
    """The closed sessions with an outcome the policy earned, and their rewards."""
    return {s: p.reward for s, p in tree.sessions.items()
            if p.closed and p.reward is not None and not is_infra_failure(p.meta)}


def infra_failures(tree: Tree) -> dict[str, int]:
    """Closed sessions of `tree` that Undertow failed, by cause."""
    causes: dict[str, int] = {}
    for paths in tree.sessions.values():
        if paths.closed and is_infra_failure(paths.meta):
            cause = str(paths.meta.get("cause") or "infra_failure")
            causes[cause] = causes.get(cause, 0) + 1
    return causes


def is_uniform(rewards: dict[str, float]) -> bool:
    """Whether every reward is the same (then every group-relative advantage is 0)."""
    return len(set(rewards.values())) <= 1


def session_rewards(tree: Tree, config: AdvantageConfig) -> dict[str, float]:
    """The reward each valid closed session enters its group with. A session that hit
    its time limit enters by `timeout_reward`: "partial_credit", the reward it was closed
    with (the grader's credit for what it had done); "tree_value", the mean reward of
    the sessions that did not time out and share the longest token prefix with it
    (`gateway/trees/tree_value.py`; its own when none shares a token); "drop", not at
    all (the arm that measures the other two)."""
    closed = valid_sessions(tree)
    if config.timeout_reward == "partial_credit":
        return dict(closed)
    finished = {s: r for s, r in closed.items() if not is_timed_out(tree, s)}
    if config.timeout_reward == "drop":
        return finished
    rewards = {}
    for session_id, reward in closed.items():
        value = None if session_id in finished else tree_value(tree, session_id, finished)
        rewards[session_id] = reward if value is None else value.value
    return rewards


def group_advantages(tree: Tree, config: AdvantageConfig) -> dict[str, float]:
    """Group-relative advantage per valid session of `tree` (GRPO): (r_s - mean) /
    (std + eps), std the population one (ddof 0); `scale="none"`: r_s - mean
    (Dr.GRPO)."""
    rewards = session_rewards(tree, config)
    if not rewards:
        return {}
    mean = sum(rewards.values()) / len(rewards)
    if config.scale == "none":
        return {s: r - mean for s, r in rewards.items()}
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards.values()) / len(rewards))
    return {s: (r - mean) / (std + config.eps) for s, r in rewards.items()}
