"""Trees as JSON (the admin API's answer) and as text (`undertow trees show`)."""

from __future__ import annotations

import math
from typing import Any

from undertow.gateway.tree import ROOT, Tree


def _logprob(value: float) -> float | None:
    return None if math.isnan(value) else value


def session_node_ids(tree: Tree, session_id: str) -> set[int]:
    paths = tree.sessions.get(session_id)
    return {node for leaf in (paths.leaves if paths else []) for node in tree.path(leaf)}


def tree_to_json(tree: Tree, session_id: str | None = None) -> dict[str, Any]:
    """Nodes (with per-token logprobs and weight versions), sessions and calls; with
    `session_id`, only the nodes on that session's paths and its calls."""
    keep = session_node_ids(tree, session_id) if session_id else None
    nodes = [{"id": node.node_id, "parent": node.parent, "token_ids": node.token_ids,
              "trainable": node.trainable, "sampled_by": node.sampled_by,
              "logprobs": [_logprob(value) for value in node.logprobs],
              "weight_versions": node.weight_versions}
             for node in tree.nodes.values()
             if node.node_id != ROOT and (keep is None or node.node_id in keep)]
    sessions = {sid: {"leaves": paths.leaves, "reward": paths.reward, "closed": paths.closed,
                      "meta": paths.meta}
                for sid, paths in tree.sessions.items() if session_id in (None, sid)}
    calls = [{"call_id": call.call_id, "session_id": call.session_id, "leaf": call.leaf,
              "num_prompt_tokens": call.num_prompt_tokens,
              "num_completion_tokens": call.num_completion_tokens, "branch": call.branch,
              "meta": call.meta}
             for call in tree.calls if session_id in (None, call.session_id)]
    return {"group": tree.group_id, "nodes": nodes, "sessions": sessions, "calls": calls,
            "num_unique_tokens": tree.num_unique_tokens,
            "num_flat_tokens": tree.num_flat_tokens}
