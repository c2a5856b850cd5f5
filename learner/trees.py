"""Group trees as the learner reads them: from the gateway's tree JSON, and from a store.

The learner may import only the tree data model of the gateway (`undertow.gateway.tree`),
so this module rebuilds `Tree` objects itself from the two forms the gateway writes:
- the admin API's tree JSON (`GET /admin/groups/{group}/tree`, `gateway/treejson.py`):
  nodes with parent, token IDs, owner, per-token logprobs (null for prompt tokens) and
  weight versions, plus sessions and calls. `tree_from_json(tree_to_json(t))` equals `t`
  node for node, IDs included; the learner also uses this form to save groups it has
  collected but not yet trained in a checkpoint;
- the store's write-ahead files (`STORE/<group>.jsonl`: CallRecord lines and session
  events), replayed with `Tree.apply` exactly as the gateway replays them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from undertow.gateway.tree import ROOT, Call, CallRecord, Node, SessionPaths, Tree


def tree_to_json(tree: Tree) -> dict[str, Any]:
    """The gateway's tree JSON of a whole group (the same fields as `treejson.py`)."""
    nodes = [{"id": node.node_id, "parent": node.parent, "token_ids": node.token_ids,
              "trainable": node.trainable, "sampled_by": node.sampled_by,
              "logprobs": [None if math.isnan(v) else v for v in node.logprobs],
              "weight_versions": node.weight_versions}
             for node in tree.nodes.values() if node.node_id != ROOT]
    sessions = {sid: {"leaves": paths.leaves, "reward": paths.reward, "closed": paths.closed,
                      "meta": paths.meta} for sid, paths in tree.sessions.items()}
    calls = [{"call_id": call.call_id, "session_id": call.session_id, "leaf": call.leaf,
              "num_prompt_tokens": call.num_prompt_tokens,
              "num_completion_tokens": call.num_completion_tokens, "branch": call.branch,
              "meta": call.meta} for call in tree.calls]
    return {"group": tree.group_id, "nodes": nodes, "sessions": sessions, "calls": calls}


def tree_from_json(data: dict[str, Any]) -> Tree:
    """Rebuilds the `Tree` that `tree_to_json` (or the gateway's admin API) described."""
    tree = Tree(data["group"])
    for raw in sorted(data["nodes"], key=lambda n: n["id"]):
        tree.nodes[raw["id"]] = Node(
            node_id=raw["id"], parent=raw["parent"], token_ids=list(raw["token_ids"]),
            logprobs=[math.nan if v is None else float(v) for v in raw["logprobs"]],
            weight_versions=[int(v) for v in raw["weight_versions"]],
            sampled_by=raw["sampled_by"])
    for node in tree.nodes.values():
        if node.parent is not None:
            tree.nodes[node.parent].children[(node.token_ids[0], node.sampled_by)] = node.node_id
    for session_id, raw in data["sessions"].items():
        tree.sessions[session_id] = SessionPaths(
            session_id, leaves=list(raw["leaves"]), reward=raw["reward"],
            closed=bool(raw["closed"]), meta=dict(raw.get("meta") or {}))
    tree.calls = [Call(c["call_id"], c["session_id"], c["leaf"], c["num_prompt_tokens"],
                       c["num_completion_tokens"], c.get("branch"), dict(c.get("meta") or {}))
                  for c in data["calls"]]
    tree._next_id = max(tree.nodes) + 1
    return tree


def load_store_tree(path: Path) -> Tree:
    """Replays one store file `STORE/<group>.jsonl`; a torn last line is ignored."""
    path = Path(path)
    tree = Tree(path.stem)
    data = path.read_bytes()
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event["kind"] == "call":
            tree.apply(CallRecord.from_json(event))
        elif event["kind"] == "session_close":
            tree.close_session(event["session_id"], event["reward"], event.get("meta"))
    return tree


def load_store_trees(store_dir: Path) -> list[Tree]:
    """Every group tree of a store directory, in group order."""
    store_dir = Path(store_dir)
    if not store_dir.is_dir():
        raise FileNotFoundError(f"no tree store at {store_dir}; give the --store directory "
                                "of a gateway")
    return [load_store_tree(path) for path in sorted(store_dir.glob("*.jsonl"))]


def group_staleness(tree: Tree, weight_version: int) -> int:
    """How many versions older than `weight_version` the oldest sampled token is
    (0 for a group with no sampled token)."""
    versions = [v for node in tree.nodes.values() if node.trainable
                for v in node.weight_versions if v >= 0]
    return max(0, weight_version - min(versions)) if versions else 0
