"""Group trees as the learner reads them from a gateway store's write-ahead files
(`STORE/<group>.jsonl`), replayed with `group_log.replay_log`, the gateway's own replay, and
their staleness. The learner imports only the gateway's tree data model
(`undertow.gateway.trees`), whose `tree.py` also holds the trees' JSON form.
"""

from __future__ import annotations

import logging
from pathlib import Path

from undertow.gateway.trees.group_log import LogLineError, replay_log
from undertow.gateway.trees.tree import Tree
from undertow.learner.errors import LearnerError

log = logging.getLogger(__name__)


class StoreFileDamaged(LearnerError, LogLineError):
    """Store file `path` has a damaged line (`line`, 1-based; `reason`): its group's tree
    cannot be replayed past it. `undertow trees repair STORE` mends the store."""

    def __init__(self, path: Path, damage: LogLineError):
        super().__init__(damage.line, damage.offset, damage.num_kept, damage.reason)
        self.path = path
        self.args = (f"{path} line {damage.line} is damaged ({damage.reason}); run "
                     f"`undertow trees repair {path.parent}` to keep every record that "
                     "still replays",)


def load_store_tree(path: Path) -> Tree:
    """Replays one store file `STORE/<group>.jsonl`; a torn last line is ignored, a
    damaged line raises `StoreFileDamaged` naming the file and the line."""
    path = Path(path)
    tree = Tree(path.stem)
    try:
        for _ in replay_log(tree, path.read_bytes()):
            pass
    except LogLineError as damage:
        raise StoreFileDamaged(path, damage) from damage
    return tree


def load_store_trees(store_dir: Path) -> list[Tree]:
    """Every group tree of a store directory, in group order; a group whose file is
    damaged is left out, with one warning naming each such file and line."""
    store_dir = Path(store_dir)
    if not store_dir.is_dir():
        raise FileNotFoundError(f"no tree store at {store_dir}; give the --store directory "
                                "of a gateway")
    trees, damaged = [], []
    for path in sorted(store_dir.glob("*.jsonl")):
        try:
            trees.append(load_store_tree(path))
        except StoreFileDamaged as damage:
            damaged.append(damage)
    if damaged:
        log.warning("tree store %s: %d damaged group(s) left out, the other %d read: %s",
                    store_dir, len(damaged), len(trees),
                    "; ".join(str(damage) for damage in damaged))
    return trees


def group_staleness(tree: Tree, weight_version: int) -> int:
    """How many versions older than `weight_version` the oldest sampled token is
    (0 for a group with no sampled token)."""
    versions = [v for node in tree.nodes.values() if node.trainable
                for v in node.weight_versions if v >= 0]
    return max(0, weight_version - min(versions)) if versions else 0
