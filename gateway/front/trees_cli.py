"""`undertow trees show|stats|repair STORE`: a tree store read back for people, and mended.

`show` prints each group's tree depth-first: one line per node with its span of
token IDs (abbreviated), whether it is trainable (`*`, sampled by the named
session) or prompt, its weight versions, and where it branches (a node with
several children is a branch point; the calls that started branches are listed
with their reasons). `stats` prints unique tokens against the tokens a per-call
log would hold (every call's prompt plus completion), and their ratio. `repair`
mends a store whose log is damaged in the middle (the gateway refuses to start on one,
naming the file and line): in each file it keeps every record before the first damaged
line, moves that line and the rest aside to `STORE/damaged/` (the records after a damaged
one may hang on the nodes it made, so none of them can be kept), and reports the calls
and sessions lost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from undertow.gateway.front.store import TreeStore
from undertow.gateway.trees.tree import ROOT, LogLineError, Tree, replay_log, session_node_ids

DAMAGED_DIR = "damaged"


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
            reward = (f"reward {paths.reward}" if paths.closed
                      else "expired, no reward" if paths.expired else "open")
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


@dataclass
class Repair:
    """What `repair_file` did to one log: `damaged_line` (1-based) and everything after
    it moved to `aside`; what the moved lines held, so far as they can be read."""

    path: Path
    num_kept: int
    damaged_line: int
    reason: str
    aside: Path
    num_lines_moved: int = 0
    num_calls_lost: int = 0
    num_unreadable: int = 0
    sessions_opened: set[str] = field(default_factory=set)
    sessions_with_calls: set[str] = field(default_factory=set)
    sessions_closed: set[str] = field(default_factory=set)

    def describe(self) -> str:
        lost = sorted(self.sessions_with_calls | self.sessions_opened | self.sessions_closed)
        return (f"{self.path}: line {self.damaged_line} is damaged ({self.reason}); kept "
                f"{self.num_kept} records before it, moved {self.num_lines_moved} lines to "
                f"{self.aside}\n"
                f"  lost: {self.num_calls_lost} calls"
                f"{f' (and {self.num_unreadable} unreadable lines)' if self.num_unreadable else ''}"
                f", {len(self.sessions_opened)} sessions opened after the damage, "
                f"{len(self.sessions_closed)} session closes (rewards)\n"
                f"  sessions that lost something: {', '.join(lost) or 'none'}")


def _first_damage(path: Path, data: bytes) -> tuple[int, int, int, str] | None:
    """(records kept, 1-based line, byte offset of the line, reason) of the first line
    that replay cannot take, or None."""
    try:
        for _ in replay_log(Tree(path.stem), data):
            pass
    except LogLineError as error:
        return error.num_kept, error.line, error.offset, error.reason
    return None


def _aside_path(store_dir: Path, group: str, line: int) -> Path:
    base = store_dir / DAMAGED_DIR / f"{group}.jsonl.from-line-{line}"
    path, number = base, 1
    while path.exists():
        path, number = base.with_name(f"{base.name}.{number}"), number + 1
    return path


def _tally(repair: Repair, tail: bytes) -> None:
    for line in tail.split(b"\n"):
        if not line.strip():
            continue
        repair.num_lines_moved += 1
        try:
            event = orjson.loads(line)
            kind, session_id = event.get("kind"), event.get("session_id")
        except (orjson.JSONDecodeError, AttributeError):
            repair.num_unreadable += 1
            continue
        if kind == "call":
            repair.num_calls_lost += 1
            repair.sessions_with_calls.add(session_id)
        elif kind == "session_open":
            repair.sessions_opened.add(session_id)
        elif kind == "session_close":
            repair.sessions_closed.add(session_id)


def repair_file(path: Path) -> Repair | None:
    """Keeps the records of one log before its first damaged line and moves the rest
    aside (written and fsync'ed before the log is cut); None when nothing is damaged.
    A torn last line (no newline) is not damage: the gateway cuts it off itself."""
    data = path.read_bytes()
    found = _first_damage(path, data[:data.rfind(b"\n") + 1])
    if found is None:
        return None
    num_kept, line, offset, reason = found
    aside = _aside_path(path.parent, path.stem, line)
    aside.parent.mkdir(exist_ok=True)
    with open(aside, "xb") as handle:
        handle.write(data[offset:])
        handle.flush()
        os.fsync(handle.fileno())
    with open(path, "r+b") as handle:
        handle.truncate(offset)
        os.fsync(handle.fileno())
    repair = Repair(path, num_kept, line, reason, aside)
    _tally(repair, data[offset:])
    return repair


def repair_store(store_dir: Path) -> list[Repair]:
    store_dir = Path(store_dir)
    if not store_dir.is_dir():
        raise FileNotFoundError(f"no tree store at {store_dir}")
    repairs = (repair_file(path) for path in sorted(store_dir.glob("*.jsonl")))
    return [repair for repair in repairs if repair is not None]


def repair(store_dir: Path) -> str:
    """Repairs every damaged log of the store; the report for people."""
    repairs = repair_store(store_dir)
    if not repairs:
        return f"{store_dir}: no damaged record; nothing changed"
    return "\n".join(repair.describe() for repair in repairs)
