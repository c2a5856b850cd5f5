"""`undertow trees show|stats STORE`: a tree store read back for people.

`show` prints each group's tree depth-first: one line per node with its span of
token IDs (abbreviated), whether it is trainable (`*`, sampled by the named
session) or prompt, its weight versions, and where it branches (a node with
several children is a branch point; the calls that started branches are listed
with their reasons). `stats` prints unique tokens against the tokens a per-call
log would hold (every call's prompt plus completion), and their ratio.
"""

from __future__ import annotations

from pathlib import Path

from undertow.gateway.store import TreeStore
from undertow.gateway.tree import ROOT, Tree, session_node_ids


def load(store_dir: Path) -> dict[str, Tree]:
    store = TreeStore(store_dir, create=False)
    for _ in store.replay(repair=False):
        pass
    return store.trees


def _span(token_ids: list[int], max_tokens: int) -> str:
    if len(token_ids) <= 2 * max_tokens:
        return " ".join(map(str, token_ids))
    head = " ".join(map(str, token_ids[:max_tokens]))
    tail = " ".join(map(str, token_ids[-max_tokens:]))
    return f"{head} … {tail}"


def _node_line(tree: Tree, node_id: int, max_tokens: int) -> str:
    node = tree.nodes[node_id]
    kind = f"* sampled by {node.sampled_by}" if node.trainable else "prompt"
    versions = sorted(set(node.weight_versions)) if node.trainable else []
    branch = f"  <branch point: {len(node.children)} children>" if len(node.children) > 1 else ""
    version_text = f" v{','.join(map(str, versions))}" if versions else ""
    return (f"[n{node_id}] {len(node.token_ids)} tok {kind}{version_text}{branch}: "
            f"{_span(node.token_ids, max_tokens)}")


def show_tree(tree: Tree, session: str | None = None, max_tokens: int = 12) -> str:
    keep = session_node_ids(tree, session) if session else None
    lines = [f"group {tree.group_id}: {len(tree.sessions)} sessions, {len(tree.calls)} calls, "
             f"{tree.num_unique_tokens} unique tokens (* = trainable)"]
    stack = [(child, "") for child in reversed(list(tree.nodes[ROOT].children.values()))]
    while stack:
        node_id, indent = stack.pop()
        if keep is not None and node_id not in keep:
            continue
        lines.append(f"{indent}{_node_line(tree, node_id, max_tokens)}")
        children = list(tree.nodes[node_id].children.values())
        stack.extend((child, indent + "  ") for child in reversed(children))
    for sid, paths in sorted(tree.sessions.items()):
        if session in (None, sid):
            reward = "open" if not paths.closed else f"reward {paths.reward}"
            lines.append(f"session {sid}: {reward}, leaves "
                         f"{', '.join(f'n{leaf}' for leaf in paths.leaves)}")
    for call in tree.calls:
        if call.branch and session in (None, call.session_id):
            lines.append(f"branch: call {call.call_id} of {call.session_id} -> n{call.leaf} "
                         f"({call.branch})")
    return "\n".join(lines)


def show(store_dir: Path, group: str | None = None, session: str | None = None,
         max_tokens: int = 12) -> str:
    trees = load(store_dir)
    if group is not None and group not in trees:
        raise ValueError(f"no group {group!r} in {store_dir}; it has {sorted(trees)}")
    chosen = [trees[group]] if group else [
        tree for tree in trees.values() if session is None or session in tree.sessions]
    if not chosen:
        raise ValueError(f"nothing to show in {store_dir} for session {session!r}")
    return "\n\n".join(show_tree(tree, session, max_tokens) for tree in chosen)


def stats(store_dir: Path) -> str:
    trees = load(store_dir)
    lines = ["| group | sessions | calls | unique tokens | per-call log tokens | ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    total_unique = total_flat = 0
    for name, tree in sorted(trees.items()):
        unique, flat = tree.num_unique_tokens, tree.num_flat_tokens
        total_unique, total_flat = total_unique + unique, total_flat + flat
        ratio = f"{flat / unique:.2f}x" if unique else "-"
        lines.append(f"| {name} | {len(tree.sessions)} | {len(tree.calls)} | {unique} | {flat} "
                     f"| {ratio} |")
    ratio = f"{total_flat / total_unique:.2f}x" if total_unique else "-"
    lines.append(f"| all | | | {total_unique} | {total_flat} | {ratio} |")
    return "\n".join(lines)
