"""Prefix cache: a radix tree over token IDs whose nodes hold the KV of their token span.

A new request looks up its longest cached prefix (`match`) and copies that KV into its slot
instead of recomputing it (`meta_info.cached_tokens`). A finished request inserts its prompt and
output KV (`insert`). Nodes on the path of a running request are locked (reference counted), so
its prefix stays cached for the sibling requests that are likely to follow (the same session's
next call, the other samples of the same task); unlocked leaves are evicted least recently used
first whenever the stored KV exceeds `max_bytes`.

The tree is used from the scheduler's worker thread only; it is not thread-safe.
"""

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Node:
    """A span of token IDs and its KV (layers, 2, kv_heads, len(token_ids), head_dim).

    Invariants: children are keyed by their first token ID; a child's span continues its
    parent's; `ref_count` counts the running requests whose matched prefix passes through it;
    only the root has no parent (and no tokens, so an empty KV).
    """

    token_ids: list[int]
    kv: torch.Tensor
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class Match:
    """The cached prefix of a sequence: `length` tokens along `nodes` (root excluded)."""

    nodes: list[Node]
    length: int


class RadixCache:
    """Radix tree of cached KV, bounded by `max_bytes` of unlocked entries."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._clock = itertools.count(1)
        self.flush()

    def flush(self) -> None:
        """Drop every entry (after a weight update the cached KV is stale)."""
        self.root = Node(token_ids=[], kv=torch.empty(0))
        self.num_bytes = 0
        self.num_tokens = 0

    def match(self, token_ids: list[int], max_length: int) -> Match:
        """The longest cached prefix of `token_ids`, at most `max_length` tokens long."""
        node, length, nodes = self.root, 0, []
        now = next(self._clock)
        while length < max_length:
            child = node.children.get(token_ids[length]) if length < len(token_ids) else None
            if child is None:
                break
            common = _common_length(child.token_ids, token_ids, length)
            common = min(common, max_length - length)
            if common == 0:
                break
            child.last_access = now
            nodes.append(child)
            length += common
            if common < len(child.token_ids):
                break
            node = child
        return Match(nodes=nodes, length=length)

    def gather(self, match: Match) -> torch.Tensor:
        """The KV of a match's tokens, (layers, 2, kv_heads, match.length, head_dim)."""
        return torch.cat([kv for _, kv in self.spans(match)], 3)

    @staticmethod
    def spans(match: Match, start: int = 0) -> list[tuple[int, torch.Tensor]]:
        """The KV of a match's positions [start, match.length) as views of the nodes' KV,
        each with the position it begins at (no copy: for writing straight into a slot)."""
        spans, offset = [], 0
        for node in match.nodes:
            end = min(offset + len(node.token_ids), match.length)
            if end > start:
                begin = max(start, offset)
                spans.append((begin, node.kv[:, :, :, begin - offset:end - offset]))
            offset = end
        return spans

    def lock(self, match: Match) -> None:
        self._add_refs(match, 1)

    def unlock(self, match: Match) -> None:
        self._add_refs(match, -1)

    @staticmethod
    def _add_refs(match: Match, delta: int) -> None:
        # Walk parent links rather than `match.nodes`: a split since `lock` inserted a new
        # node into the path, carrying the same count.
        node = match.nodes[-1] if match.nodes else None
        while node is not None and node.parent is not None:
            node.ref_count += delta
            node = node.parent

    def insert(self, token_ids: list[int], read_kv: Callable[[int, int], torch.Tensor]) -> None:
        """Cache `token_ids`; `read_kv(start, end)` returns the KV of positions [start, end),
        and is called only for the part not cached yet. Evicts to stay under the bound."""
        node, length = self.root, 0
        now = next(self._clock)
        while length < len(token_ids):
            child = node.children.get(token_ids[length])
            if child is None:
                new = Node(token_ids=list(token_ids[length:]), parent=node, last_access=now,
                           kv=read_kv(length, len(token_ids)).contiguous())
                node.children[token_ids[length]] = new
                self.num_bytes += new.num_bytes
                self.num_tokens += len(new.token_ids)
                break
            common = _common_length(child.token_ids, token_ids, length)
            if common < len(child.token_ids):
                child = self._split(child, common)
            child.last_access = now
            node, length = child, length + common
        self.evict()

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens; return the new upper part (the node keeps the rest)."""
        assert node.parent is not None, "the root is never split"
        upper = Node(token_ids=node.token_ids[:at], kv=node.kv[:, :, :, :at].clone(),
                     parent=node.parent, ref_count=node.ref_count, last_access=node.last_access)
        upper.children[node.token_ids[at]] = node
        node.parent.children[upper.token_ids[0]] = upper
        node.token_ids = node.token_ids[at:]
        node.kv = node.kv[:, :, :, at:].clone()
        node.parent = upper
        return upper

    def evict(self) -> None:
        """Remove unlocked leaves, least recently used first, until under `max_bytes`."""
        if self.num_bytes <= self.max_bytes:
            return
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()
                if leaf.ref_count == 0]
        heapq.heapify(heap)
        while self.num_bytes > self.max_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None, "the root is never a leaf here"
            del parent.children[leaf.token_ids[0]]
            self.num_bytes -= leaf.num_bytes
            self.num_tokens -= len(leaf.token_ids)
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _leaves(self) -> list[Node]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves


def _common_length(span: list[int], token_ids: list[int], offset: int) -> int:
    """How many leading tokens of `span` equal token_ids[offset:]."""
    limit = min(len(span), len(token_ids) - offset)
    for i in range(limit):
        if span[i] != token_ids[offset + i]:
            return i
    return limit
