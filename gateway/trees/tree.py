"""Prefix trees of token IDs: the training record of one task group. The gateway records
every call of a group's sessions into one `Tree`; the learner packs it into one sequence.
Plain data, importing nothing else of the gateway. See docs/design.md, "Tree data model".
"""

from __future__ import annotations

import contextlib
import math
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from undertow.gateway.trees.errors import TreeError

ROOT = 0


@dataclass
class Node:
    """A span of token IDs (only the root has no `parent`). `logprobs`/`weight_versions`
    are per token; prompt tokens carry NaN and -1. `children` maps (first token ID, owner)
    to a child node ID. `path_end` is the number of IDs from the root to this node's last
    (the length of the path that ends here), kept as nodes are added and split, so that
    reading a path's length, or whether a node lies on a path, does not walk the path;
    `path_crc` is that path's `crc_of_ids`, kept alike."""

    node_id: int
    parent: int | None
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    sampled_by: str | None
    children: dict[tuple[int, str | None], int] = field(default_factory=dict)
    path_end: int = 0
    path_crc: int = 0

    @property
    def trainable(self) -> bool:
        return self.sampled_by is not None


def crc_of_ids(token_ids: Sequence[int], crc: int = 0) -> int:
    """The CRC-32 of token IDs (each as 8 bytes, the machine's order), continuing `crc`:
    `crc_of_ids(b, crc_of_ids(a)) == crc_of_ids(a + b)`."""
    return zlib.crc32(array("q", token_ids).tobytes(), crc)


@dataclass(frozen=True)
class CallRecord:
    """One call as stored: the new tokens hang below `anchor` = (node ID, offset),
    i.e. after the first `offset` tokens of that node (the root has offset 0).
    The first `num_prompt` of `token_ids` are new prompt tokens, the rest sampled.
    `anchor_path` = (length, `crc_of_ids`) of the path of IDs up to the anchor, and
    `first_id` the first node ID the record may take; both None in records written
    before they existed (replayed as stored, unverified)."""

    call_id: str
    session_id: str
    anchor: tuple[int, int]
    token_ids: list[int]
    num_prompt: int
    logprobs: list[float]
    weight_versions: list[int]
    branch: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    anchor_path: tuple[int, int] | None = None
    first_id: int | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"kind": "call", "call_id": self.call_id, "session_id": self.session_id,
                "anchor": list(self.anchor), "token_ids": self.token_ids,
                "num_prompt": self.num_prompt, "logprobs": self.logprobs,
                "weight_versions": self.weight_versions, "branch": self.branch,
                "meta": self.meta}
        if self.anchor_path is not None:
            data["anchor_path"] = list(self.anchor_path)
        if self.first_id is not None:
            data["first_id"] = self.first_id
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CallRecord:
        return cls(call_id=data["call_id"], session_id=data["session_id"],
                   anchor=(int(data["anchor"][0]), int(data["anchor"][1])),
                   token_ids=list(data["token_ids"]), num_prompt=int(data["num_prompt"]),
                   logprobs=[float(x) for x in data["logprobs"]],
                   weight_versions=list(data["weight_versions"]), branch=data.get("branch"),
                   meta=dict(data.get("meta") or {}),
                   anchor_path=(int(data["anchor_path"][0]), int(data["anchor_path"][1]))
                   if data.get("anchor_path") is not None else None,
                   first_id=int(data["first_id"]) if data.get("first_id") is not None else None)


@dataclass
class Call:
    """What the tree keeps of a recorded call: its session, leaf, sizes and metadata."""

    call_id: str
    session_id: str
    leaf: int
    num_prompt_tokens: int
    num_completion_tokens: int
    branch: str | None
    meta: dict[str, Any]


@dataclass
class SessionPaths:
    """A session's leaves (one per path root→leaf), and its outcome once closed. An
    expired session (an idle auto session, `front/auto_sessions.py`) ended without a reward:
    it is not `closed`, so nothing trains on it."""

    session_id: str
    leaves: list[int] = field(default_factory=list)
    reward: float | None = None
    closed: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    expired: bool = False


class Tree:
    """The prefix tree of one task group. Node 0 is an empty root.

    Invariants: a node's tokens have one owner, `sampled_by`: None for prompt tokens, else
    the one session whose policy sampled them all, so each trainable token belongs to
    exactly one session. A token extends a child only when its ID matches and the owner is
    compatible (a prompt token follows a prompt node or its own session's sampled one; a
    sampled token only its own session's); else it starts a sibling. A split's tail keeps
    the node's ID and its head takes a new one, and IDs go in insertion order, so replaying
    the same records rebuilds the same tree, IDs included."""

    def __init__(self, group_id: str):
        self.group_id = group_id
        self.nodes: dict[int, Node] = {ROOT: Node(ROOT, None, [], [], [], None)}
        self.sessions: dict[str, SessionPaths] = {}
        self.calls: list[Call] = []
        self._next_id = 1
        self._undo: list[Callable[[], object]] | None = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tree]:
        """Every change made inside is undone, in reverse order, if the block raises;
        node IDs are handed out again as if the changes had never happened."""
        if self._undo is not None:
            raise TreeError("tree transactions do not nest")
        self._undo, next_id = [], self._next_id
        try:
            yield self
        except BaseException:
            for undo in reversed(self._undo):
                undo()
            self._next_id = next_id
            raise
        finally:
            self._undo = None

    def _on_undo(self, undo: Callable[[], object]) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def add_call(self, call_id: str, session_id: str, prompt_ids: Sequence[int],
                 completion_ids: list[int], logprobs: list[float], weight_versions: list[int],
                 branch: str | None = None, meta: dict[str, Any] | None = None,
                 extends_leaf: int | None = None) -> CallRecord:
        """Records a call given its full prompt and completion; returns the compact record
        (already applied) that a store appends to its log.

        `extends_leaf`: the caller guarantees that the prompt begins with exactly the
        tokens of the path to this leaf (token truth), so matching starts there and
        costs only the new suffix, not the history."""
        if len(logprobs) != len(completion_ids) or len(weight_versions) != len(completion_ids):
            raise TreeError(f"call {call_id}: {len(completion_ids)} completion tokens but "
                            f"{len(logprobs)} logprobs and {len(weight_versions)} versions")
        if not math.isfinite(sum(logprobs)):  # NaN or infinity in any of them
            raise TreeError(f"call {call_id}: the engine gave a logprob that is not a finite "
                            "number (NaN where it reported none); the call is not recorded")
        node_id, offset, num_matched = self._match(session_id, prompt_ids, extends_leaf)
        record = CallRecord(call_id=call_id, session_id=session_id, anchor=(node_id, offset),
                            token_ids=[*prompt_ids[num_matched:], *completion_ids],
                            num_prompt=len(prompt_ids) - num_matched, logprobs=list(logprobs),
                            weight_versions=list(weight_versions), branch=branch,
                            meta=dict(meta or {}),
                            anchor_path=(num_matched, self._crc_at(node_id, offset)),
                            first_id=self._next_id)
        self.apply(record)
        return record

    def apply(self, record: CallRecord) -> int:
        """Applies a stored record (live or on replay); returns the call's leaf node ID.
        A record with an `anchor_path` lands where that path ends on its anchor node (so
        a split that a lost record made, and this one counted on, is not needed), or is
        refused when the node holds another path there; with a `first_id`, its nodes
        take their recorded IDs (skipping those of lost records)."""
        anchor = self._anchor_of(record)
        if record.first_id is not None:
            if record.first_id < self._next_id:
                raise TreeError(f"call {record.call_id}: its first node ID {record.first_id} "
                                f"is already taken (next is {self._next_id}): out of order")
            self._next_id = record.first_id
        node_id = self._split_at(*anchor)
        prompt = record.token_ids[:record.num_prompt]
        sampled = record.token_ids[record.num_prompt:]
        node_id = self._insert(node_id, prompt, None, [math.nan] * len(prompt), [-1] * len(prompt))
        node_id = self._insert(node_id, sampled, record.session_id, record.logprobs,
                               record.weight_versions)
        self._set_leaf(record.session_id, node_id)
        self.calls.append(Call(record.call_id, record.session_id, node_id, record.num_prompt,
                               len(sampled), record.branch, record.meta))
        self._on_undo(self.calls.pop)
        return node_id

    def _anchor_of(self, record: CallRecord) -> tuple[int, int]:
        """The (node, offset) where `record`'s new tokens start (see `apply`)."""
        node_id, offset = record.anchor
        node = self.nodes.get(node_id)
        if node is None:
            raise TreeError(f"call {record.call_id}: anchor node {node_id} is unknown")
        if record.anchor_path is not None:
            length, crc = record.anchor_path
            offset = length - (node.path_end - len(node.token_ids))
            if not 0 <= offset <= len(node.token_ids) or self._crc_at(node_id, offset) != crc:
                raise TreeError(f"call {record.call_id}: anchor node {node_id} does not hold "
                                "the path the call was recorded on")
        elif not 0 <= offset <= len(node.token_ids):
            raise TreeError(f"call {record.call_id}: offset {offset} is outside anchor node "
                            f"{node_id} ({len(node.token_ids)} tokens)")
        return node_id, offset

    def _crc_at(self, node_id: int, offset: int) -> int:
        """`crc_of_ids` of the path up to the first `offset` tokens of the node."""
        node = self.nodes[node_id]
        if offset == len(node.token_ids):
            return node.path_crc
        return crc_of_ids(node.token_ids[:offset], self.nodes[self._parent(node)].path_crc)

    def close_session(self, session_id: str, reward: float, meta: dict[str, Any] | None = None):
        paths = self.sessions.setdefault(session_id, SessionPaths(session_id))
        paths.reward, paths.closed, paths.meta = float(reward), True, dict(meta or {})

    def expire_session(self, session_id: str) -> None:
        self.sessions.setdefault(session_id, SessionPaths(session_id)).expired = True

    def path(self, leaf: int) -> list[int]:
        """Node IDs from the root's first child down to `leaf`."""
        nodes = []
        while leaf != ROOT:
            nodes.append(leaf)
            leaf = self._parent(self.nodes[leaf])
        return nodes[::-1]

    def path_token_ids(self, leaf: int) -> list[int]:
        token_ids: list[int] = []
        for node_id in self.path(leaf):
            token_ids += self.nodes[node_id].token_ids
        return token_ids

    def path_length(self, leaf: int) -> int:
        return self.nodes[leaf].path_end

    def on_path(self, node_id: int, leaf: int) -> bool:
        """Whether `node_id` lies on the path to `leaf` (walks up from `leaf` only as far
        as `node_id`'s depth in IDs: a step or two for a session's previous leaf)."""
        depth = self.nodes[node_id].path_end
        while leaf != ROOT and self.nodes[leaf].path_end > depth:
            leaf = self._parent(self.nodes[leaf])
        return leaf == node_id

    @property
    def num_unique_tokens(self) -> int:
        return sum(len(node.token_ids) for node in self.nodes.values())

    @property
    def num_flat_tokens(self) -> int:
        """Tokens that a per-call log would hold: every call's prompt plus completion."""
        return sum(self.nodes[call.leaf].path_end for call in self.calls)

    def _match(self, session_id: str, token_ids: Sequence[int],
               extends_leaf: int | None = None) -> tuple[int, int, int]:
        """Longest prefix of `token_ids` (as prompt of `session_id`) already in the tree:
        returns (node ID, offset in that node, number of tokens matched). Spans are
        compared a node at a time (list slices), not token by token."""
        node, offset, num_matched = self.nodes[ROOT], 0, 0
        if extends_leaf is not None:
            node = self.nodes[extends_leaf]
            offset, num_matched = len(node.token_ids), self.path_length(extends_leaf)
        while num_matched < len(token_ids):
            if offset == len(node.token_ids):
                child = self._prompt_child(node, token_ids[num_matched], session_id)
                if child is None:
                    break
                node, offset = child, 0
            num_same = min(len(node.token_ids) - offset, len(token_ids) - num_matched)
            if (node.token_ids[offset:offset + num_same]
                    != token_ids[num_matched:num_matched + num_same]):
                num_same = next(i for i in range(num_same) if node.token_ids[offset + i]
                                != token_ids[num_matched + i])
            offset += num_same
            num_matched += num_same
            if offset < len(node.token_ids):
                break
        return node.node_id, offset, num_matched

    def _prompt_child(self, node: Node, token_id: int, session_id: str) -> Node | None:
        for owner in (None, session_id):
            child_id = node.children.get((token_id, owner))
            if child_id is not None:
                return self.nodes[child_id]
        return None

    def _split_at(self, node_id: int, offset: int) -> int:
        """Makes (node, offset) a node boundary; returns the node that ends there."""
        node = self.nodes[node_id]
        if offset == len(node.token_ids):
            return node_id
        if offset == 0:
            return self._parent(node)
        parent = self.nodes[self._parent(node)]
        head = Node(self._new_id(), node.parent, node.token_ids[:offset], node.logprobs[:offset],
                    node.weight_versions[:offset], node.sampled_by,
                    path_end=node.path_end - len(node.token_ids) + offset,
                    path_crc=crc_of_ids(node.token_ids[:offset], parent.path_crc))
        parent.children[(head.token_ids[0], head.sampled_by)] = head.node_id
        node.token_ids, node.logprobs = node.token_ids[offset:], node.logprobs[offset:]
        node.weight_versions = node.weight_versions[offset:]
        node.parent = head.node_id
        head.children[(node.token_ids[0], node.sampled_by)] = node.node_id
        self.nodes[head.node_id] = head
        self._on_undo(lambda: self._join(head, node))
        return head.node_id

    def _join(self, head: Node, node: Node) -> None:
        """Undoes `_split_at`: `node` takes back the tokens of `head`, which goes."""
        node.token_ids = head.token_ids + node.token_ids
        node.logprobs = head.logprobs + node.logprobs
        node.weight_versions = head.weight_versions + node.weight_versions
        node.parent = head.parent
        self.nodes[self._parent(head)].children[(node.token_ids[0], node.sampled_by)] = node.node_id
        del self.nodes[head.node_id]

    def _insert(self, parent_id: int, token_ids: list[int], owner: str | None,
                logprobs: list[float], weight_versions: list[int]) -> int:
        """Hangs `token_ids` below `parent_id`, following matching children of the same
        owner first; returns the node that ends the sequence."""
        done = 0
        while done < len(token_ids):
            parent = self.nodes[parent_id]
            child_id = parent.children.get((token_ids[done], owner))
            if child_id is None:
                node = Node(self._new_id(), parent_id, token_ids[done:], logprobs[done:],
                            weight_versions[done:], owner,
                            path_end=parent.path_end + len(token_ids) - done,
                            path_crc=crc_of_ids(token_ids[done:], parent.path_crc))
                self.nodes[node.node_id] = node
                parent.children[(token_ids[done], owner)] = node.node_id
                self._on_undo(lambda node=node: self._remove_leaf_node(node))
                return node.node_id
            child = self.nodes[child_id]
            num_same = 0
            limit = min(len(child.token_ids), len(token_ids) - done)
            while num_same < limit and child.token_ids[num_same] == token_ids[done + num_same]:
                num_same += 1
            parent_id = self._split_at(child_id, num_same)
            done += num_same
        return parent_id

    def _remove_leaf_node(self, node: Node) -> None:
        del self.nodes[self._parent(node)].children[(node.token_ids[0], node.sampled_by)]
        del self.nodes[node.node_id]

    @staticmethod
    def _parent(node: Node) -> int:
        """The parent of a node that is not the root."""
        if node.parent is None:
            raise TreeError("the root node has no parent")
        return node.parent

    def _set_leaf(self, session_id: str, leaf: int) -> None:
        paths = self.sessions.get(session_id)
        if paths is None:
            paths = self.sessions[session_id] = SessionPaths(session_id)
            self._on_undo(lambda: self.sessions.pop(session_id))
        old_leaves = paths.leaves
        paths.leaves = [old for old in paths.leaves if not self.on_path(old, leaf)] + [leaf]
        self._on_undo(lambda: setattr(paths, "leaves", old_leaves))

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1


# JSON form (the admin API's answer, the learner's checkpoints). `tree_from_json` inverts
# `tree_to_json` node for node, IDs included.


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
                      "meta": paths.meta, "expired": paths.expired}
                for sid, paths in tree.sessions.items() if session_id in (None, sid)}
    calls = [{"call_id": call.call_id, "session_id": call.session_id, "leaf": call.leaf,
              "num_prompt_tokens": call.num_prompt_tokens,
              "num_completion_tokens": call.num_completion_tokens, "branch": call.branch,
              "meta": call.meta}
             for call in tree.calls if session_id in (None, call.session_id)]
    return {"group": tree.group_id, "nodes": nodes, "sessions": sessions, "calls": calls,
            "num_unique_tokens": tree.num_unique_tokens,
            "num_flat_tokens": tree.num_flat_tokens}


def _set_path_ends(tree: Tree) -> None:
    """Sets every node's `path_end` and `path_crc`, parents before children (a split's
    head has a larger ID than the node below it, so ID order would not do)."""
    below = [tree.nodes[ROOT]]
    while below:
        node = below.pop()
        for child_id in node.children.values():
            child = tree.nodes[child_id]
            child.path_end = node.path_end + len(child.token_ids)
            child.path_crc = crc_of_ids(child.token_ids, node.path_crc)
            below.append(child)


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
    _set_path_ends(tree)
    for session_id, raw in data["sessions"].items():
        tree.sessions[session_id] = SessionPaths(
            session_id, leaves=list(raw["leaves"]), reward=raw["reward"],
            closed=bool(raw["closed"]), meta=dict(raw.get("meta") or {}),
            expired=bool(raw.get("expired")))
    tree.calls = [Call(c["call_id"], c["session_id"], c["leaf"], c["num_prompt_tokens"],
                       c["num_completion_tokens"], c.get("branch"), dict(c.get("meta") or {}))
                  for c in data["calls"]]
    tree._next_id = max(tree.nodes) + 1
    return tree
