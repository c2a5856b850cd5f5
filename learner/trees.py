"""Group trees as the learner reads them from a gateway store, and their staleness.

The learner may import only the tree data model of the gateway (`undertow.gateway.trees`):
`tree.py` also holds the JSON form of trees (`tree_to_json`, `tree_from_json`: the admin
API's answer, and the form checkpoints keep); this module reads the other form the gateway
writes:
- the store's write-ahead files (`STORE/<group>.jsonl`: CallRecord lines and session
  events), replayed with `group_log.replay_log`, the replay the gateway runs (checksums
  verified).
"""

from __future__ import annotations

from pathlib import Path

from undertow.gateway.trees.group_log import replay_log
from undertow.gateway.trees.tree import Tree


def load_store_tree(path: Path) -> Tree:
    """Replays one store file `STORE/<group>.jsonl`; a torn last line is ignored, a
    damaged line raises `LogLineError` naming it."""
    path = Path(path)
    tree = Tree(path.stem)
    for _ in replay_log(tree, path.read_bytes()):
        pass
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
