"""`undertow trees show|stats|repair STORE`: a tree store read back for people, and mended.
`show` and `stats` read the groups that replay and name the damaged ones; `repair` keeps
every record of a damaged log that still replays (docs/api.md, "When the store's disk fills,
or a log is damaged").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from undertow.gateway.front.store import StoreDamaged, TreeStore
from undertow.gateway.trees.group_log import (
    LogLineError,
    ReplayReport,
    encode_event,
    replay_log,
)
from undertow.gateway.trees.tree import ROOT, Tree, session_node_ids

DAMAGED_DIR = "damaged"
REPAIR_CAUSE = "error:store"
SESSION_ID = re.compile(rb'"session_id":\s*"([^"]+)"')


def load(store_dir: Path) -> tuple[dict[str, Tree], dict[str, StoreDamaged]]:
    """The store's trees, and its damaged groups (set aside, not in the trees)."""
    store = TreeStore(store_dir, create=False)
    for _ in store.replay(repair=False):
        pass
    return dict(store.trees), store.damaged


def _damage_notes(damaged: dict[str, StoreDamaged]) -> list[str]:
    return [f"group {group} is set aside: {damage}" for group, damage in sorted(damaged.items())]


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
    """The tree depth-first, a line per node: its span of IDs (abbreviated), `*` and the
    session where trainable, its weight versions, and the calls that started branches
    with their reasons."""
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
    trees, damaged = load(store_dir)
    if group in damaged:
        raise ValueError(_damage_notes({group: damaged[group]})[0])
    if group is not None and group not in trees:
        raise ValueError(f"no group {group!r} in {store_dir}; it has {sorted(trees)}")
    chosen = [trees[group]] if group else [
        tree for tree in trees.values() if session is None or session in tree.sessions]
    if not chosen:
        raise ValueError(f"nothing to show in {store_dir} for session {session!r}")
    shown = [show_tree(tree, session, max_tokens) for tree in chosen]
    return "\n\n".join(shown + ([] if group else _damage_notes(damaged)))


def stats(store_dir: Path) -> str:
    """Per group, unique tokens against those a per-call log would hold, and the ratio."""
    trees, damaged = load(store_dir)
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
    return "\n".join(lines + _damage_notes(damaged))


@dataclass
class Repair:
    """What `repair_file` did to one log: the lines left out (`skipped`, each a
    `LogLineError` with its line and reason) moved to `aside`, `num_kept` records kept;
    what the moved lines held, so far as they can be read."""

    path: Path
    num_kept: int
    skipped: list[LogLineError]
    aside: Path
    num_calls_lost: int = 0
    num_unreadable: int = 0
    sessions_opened: set[str] = field(default_factory=set)
    sessions_with_calls: set[str] = field(default_factory=set)
    sessions_closed: set[str] = field(default_factory=set)
    sessions_marked: set[str] = field(default_factory=set)

    def describe(self) -> str:
        lost = sorted(self.sessions_with_calls | self.sessions_opened | self.sessions_closed)
        shown = "; ".join(f"line {error.line}: {error.reason}" for error in self.skipped[:5])
        more = f"; and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
        return (f"{self.path}: kept {self.num_kept} records, moved {len(self.skipped)} lines "
                f"that do not replay to {self.aside} ({shown}{more})\n"
                f"  lost: {self.num_calls_lost} calls"
                f"{f' (and {self.num_unreadable} unreadable lines)' if self.num_unreadable else ''}"
                f", {len(self.sessions_opened)} session opens, "
                f"{len(self.sessions_closed)} session closes (rewards)\n"
                f"  sessions that lost something: {', '.join(lost) or 'none'}"
                + (f"\n  closed as infra failures ({REPAIR_CAUSE}, never trained): "
                   f"{', '.join(sorted(self.sessions_marked))}" if self.sessions_marked else ""))


def _aside_path(store_dir: Path, group: str, line: int) -> Path:
    base = store_dir / DAMAGED_DIR / f"{group}.jsonl.from-line-{line}"
    path, number = base, 1
    while path.exists():
        path, number = base.with_name(f"{base.name}.{number}"), number + 1
    return path


def _tally(repair: Repair, lines: list[bytes]) -> None:
    for line in lines:
        try:
            event = orjson.loads(line)
            kind, session_id = event.get("kind"), event.get("session_id")
        except (orjson.JSONDecodeError, AttributeError):
            repair.num_unreadable += 1
            named = SESSION_ID.search(line)   # a cut-off record may still name its session
            if named:
                repair.sessions_with_calls.add(named[1].decode(errors="replace"))
            continue
        if kind == "call":
            repair.num_calls_lost += 1
            repair.sessions_with_calls.add(session_id)
        elif kind == "session_open":
            repair.sessions_opened.add(session_id)
        elif kind == "session_close":
            repair.sessions_closed.add(session_id)


def _kept_line(line: bytes, marked: set[str], repair: Repair) -> bytes:
    """A kept line as the repaired log has it: the close of a session that lost a call
    rewritten as an infra failure's (its closer's cause kept as `scaffold_cause`)."""
    if b'"session_close"' not in line:
        return line + b"\n"
    event = orjson.loads(line)
    if event.get("kind") != "session_close" or event.get("session_id") not in marked:
        return line + b"\n"
    event.pop("crc", None)
    meta = dict(event.get("meta") or {})
    if not meta.get("infra_failure"):
        meta.update(scaffold_cause=meta.get("cause"), cause=REPAIR_CAUSE)
    event["meta"] = {**meta, "infra_failure": True,
                     "error": f"undertow trees repair: its log lost records ({repair.path})"}
    repair.sessions_marked.add(event["session_id"])
    return encode_event(event)


def _write_durably(path: Path, data: bytes, mode: str = "xb") -> None:
    with open(path, mode) as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def repair_file(path: Path) -> Repair | None:
    """Keeps every record of one log that still replays and moves the lines that do not
    aside (written and fsync'ed before the log is replaced); None when nothing is
    damaged. A torn last line (no newline) is not damage: the gateway cuts it off itself."""
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    report = ReplayReport()
    num_kept = sum(1 for _ in replay_log(Tree(path.stem), complete, report, skip_damaged=True))
    if not report.skipped:
        return None
    lines = complete.split(b"\n")[:-1]
    left_out = {error.line for error in report.skipped}
    moved = [lines[number - 1] for number in sorted(left_out)]
    repair = Repair(path, num_kept, report.skipped,
                    _aside_path(path.parent, path.stem, report.skipped[0].line))
    _tally(repair, moved)
    repair.aside.parent.mkdir(exist_ok=True)
    torn = data[len(complete):]  # the gateway would cut it off: kept with the damage
    _write_durably(repair.aside, b"".join(line + b"\n" for line in moved) + torn)
    fresh = path.with_name(f"{path.name}.repairing")
    _write_durably(fresh, b"".join(_kept_line(line, repair.sessions_with_calls, repair)
                                   for number, line in enumerate(lines, start=1)
                                   if number not in left_out), mode="wb")
    os.replace(fresh, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
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
