"""Tree packing: the trees of a step as micro-batches of packed token sequences.
`pack_step` walks each group tree depth-first, cuts its nodes into units (a node, or a chunk
of a long node), lists every trainable token as a *term* (the token, the session that trains
on it, the path it counts on, its behaviour logprob, the session's advantage, its version
gap) and places the units into micro-batches bounded by `max_tokens`; the learner runs the
model once per micro-batch (`model.py`) and sums the losses (`losses.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from undertow.gateway.trees.tree import ROOT, Tree
from undertow.learner.errors import EmptyStepError

SessionKey = tuple[str, str]
"""(group ID, session ID): session IDs need only be unique within a group."""


@dataclass(frozen=True)
class Unit:
    """Tokens [start, end) of node `node_id` of tree `tree_index`. `key` is the unit's
    depth-first index over the whole step (ancestors have smaller keys); `depth` is the
    position ID of its first token; `parent` is the key of the unit before it on its
    path (None for a tree's first unit)."""

    key: int
    tree_index: int
    node_id: int
    start: int
    end: int
    parent: int | None
    depth: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class MicroBatch:
    """One packed sequence of T tokens and the N terms trained in it.

    `unit_index[i]` is the index (into `unit_keys`) of token i's unit;
    `unit_ancestors[a, b]` is True iff unit b is an ancestor-or-self of unit a.
    `term_ids` index the step-level term arrays of `PackedStep`.

    Invariants (tests/learner/test_packing.py): the units are closed under ancestors,
    in depth-first order, so every token sees its full context; a unit is trained in
    exactly one micro-batch and appears in others only as context (whole subtrees stay
    together where they fit, so siblings share one copy of their prefix).
    `position_ids[i]` is token i's depth in its path; `attention_mask()[i, j]` allows j
    iff j is an ancestor-or-self of i. A term's `predictor` is the packed index of the
    token before it on its path; a tree's first token has none and is never a term. The
    tree gives each sampled token one owner (`Node.sampled_by`), so one term, even on
    several paths of its session; the term lists map term -> session so that a data
    model where several sessions train a token would only add terms.
    """

    token_ids: torch.Tensor          # (T,) long
    position_ids: torch.Tensor       # (T,) long
    unit_keys: list[int]
    unit_parents: list[int | None]   # parent key of each unit (None for a tree's first)
    unit_index: torch.Tensor         # (T,) long
    unit_ancestors: torch.Tensor     # (U, U) bool
    term_ids: torch.Tensor           # (N,) long
    term_token_index: torch.Tensor   # (N,) long, packed index of the scored token
    term_predictor_index: torch.Tensor  # (N,) long, packed index of the token before it
    num_trained_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    def allowed(self) -> torch.Tensor:
        """(T, T) bool: [i, j] iff token j is an ancestor-or-self of token i."""
        units = self.unit_index
        across = self.unit_ancestors[units[:, None], units[None, :]]
        same = units[:, None] == units[None, :]
        causal = torch.ones(self.num_tokens, self.num_tokens, dtype=torch.bool).tril()
        return across & (~same | causal)

    def attention_mask(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(T, T) additive mask: 0 where allowed, the dtype's minimum elsewhere."""
        allowed = self.allowed()
        mask = torch.zeros(allowed.shape, dtype=dtype)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@dataclass
class PackedStep:
    """The packed trees of one step: micro-batches plus step-level term arrays.

    Invariants: every trainable token of an included session (on a selected path)
    is exactly one term and is trained in exactly one micro-batch; `term_session`
    indexes `session_keys`; `term_path` is the index of the first selected path of
    that session containing the token; `term_origin[k]` = (tree index, node ID,
    offset in node) identifies term k's token in its tree; `units[key]` is the unit
    with that key (`MicroBatch.unit_keys`). `term_version_gap[k]` >= 0 is how many
    versions the weights that sampled term k's token are behind the weights the step
    trains (`pack_step`'s `weight_version`; 0 where either is unknown). `sequence_keep`
    is filled on first use by `objective.sequence_keep_of` when the loss has a
    sequence mask.
    """

    session_keys: list[SessionKey]
    micro_batches: list[MicroBatch]
    term_session: torch.Tensor       # (N,) long
    term_path: torch.Tensor          # (N,) long
    behaviour_logprobs: torch.Tensor  # (N,) float64
    advantages: torch.Tensor         # (N,) float64, the term's session's advantage
    term_version_gap: torch.Tensor   # (N,) long
    term_origin: list[tuple[int, int, int]]
    units: list[Unit]
    sequence_keep: torch.Tensor | None = None   # (N,) bool

    @property
    def num_terms(self) -> int:
        return int(self.term_session.numel())

    @property
    def num_unique_tokens(self) -> int:
        return sum(unit.num_tokens for unit in self.units)

    @property
    def num_packed_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)


def selected_leaves(tree: Tree, session_id: str, max_paths: int | None) -> list[int]:
    """The session's paths the loss counts: all leaves, or the `max_paths` most recent."""
    leaves = tree.sessions[session_id].leaves
    return list(leaves) if max_paths is None else list(leaves[-max_paths:])


LONG_PATHS = ("split", "whole")


def pack_step(trees: list[Tree], advantages: dict[SessionKey, float], max_tokens: int,
              max_paths_per_session: int | None = None, long_paths: str = "split",
              weight_version: int | None = None) -> PackedStep:
    """Packs the sessions named in `advantages` (others are context at most).

    `weight_version`: the version of the weights the step trains (the learner's
    `state.step`), against which each term's version gap is taken; None (SFT, tests of
    other things) gives every term gap 0, as does a token whose sampling version the
    engine did not report (-1 in the tree).

    `max_tokens` bounds each micro-batch, except where a subtree plus its context does
    not fit in one, by `long_paths`:
    - "split": the subtree is split unit by unit, each micro-batch repeating its units'
      full context (one unit plus its context is never split, so a path longer than
      the bound yields a longer micro-batch). A path of T tokens then costs about
      T^2 / (2 * unit) packed tokens: every unit past the bound brings its whole
      context again.
    - "whole": where the subtree starts with a chain (a long path, or a long node), it
      goes whole into one micro-batch of its own, its context once; where it branches
      at once, its first unit is placed and its children packed the same way. A long
      path then costs its own tokens once. Such a micro-batch is longer than
      `max_tokens`; `PolicyModel` scores it in segments of `max_segment_tokens`
      (`segments.py`), so set that to `max_tokens` to keep activations within it.
    Raises EmptyStepError naming the sessions when there is no trainable token.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if long_paths not in LONG_PATHS:
        raise ValueError(f"long_paths must be one of {LONG_PATHS}, got {long_paths!r}")
    units, children = [], {}
    terms = _Terms(advantages)
    for tree_index, tree in enumerate(trees):
        sessions = [s for s in tree.sessions if (tree.group_id, s) in advantages]
        needed, owner_path = _needed_nodes(tree, sessions, max_paths_per_session)
        num_before = len(units)
        _cut_units(tree, tree_index, needed, max(1, max_tokens // 4), units, children)
        for unit in units[num_before:]:
            terms.add_unit(tree, unit, owner_path)
    if not terms.session:
        names = sorted(f"{g}/{s}" for g, s in advantages)
        raise EmptyStepError(f"no trainable token in the step's sessions {names}: every token "
                             "is a prompt token; check that the gateway recorded completions")
    plans = _plan(units, children, max_tokens, long_paths == "whole")
    micro_batches = [_materialize(trees, units, keys, trained, terms) for keys, trained in plans]
    return PackedStep(
        session_keys=terms.session_keys, micro_batches=micro_batches,
        term_session=torch.tensor(terms.session), term_path=torch.tensor(terms.path),
        behaviour_logprobs=torch.tensor(terms.behaviour, dtype=torch.float64),
        advantages=torch.tensor(terms.advantage, dtype=torch.float64),
        term_version_gap=version_gaps(terms.version, weight_version),
        term_origin=terms.origin, units=units)


def version_gaps(versions: list[int], weight_version: int | None) -> torch.Tensor:
    """(N,) long: `weight_version` minus each sampling version, at least 0; 0 where
    either is unknown (None, or a version < 0)."""
    sampled = torch.tensor(versions, dtype=torch.long)
    if weight_version is None:
        return torch.zeros_like(sampled)
    gaps = (weight_version - sampled).clamp(min=0)
    return torch.where(sampled >= 0, gaps, 0)


def _needed_nodes(tree: Tree, sessions: list[str], max_paths: int | None
                  ) -> tuple[set[int], dict[int, int]]:
    """Nodes on the selected paths, and for each node sampled by its path's session the
    index of the first selected path of that session through it."""
    needed: set[int] = set()
    owner_path: dict[int, int] = {}
    for session_id in sessions:
        for path_index, leaf in enumerate(selected_leaves(tree, session_id, max_paths)):
            for node_id in tree.path(leaf):
                needed.add(node_id)
                if tree.nodes[node_id].sampled_by == session_id:
                    owner_path.setdefault(node_id, path_index)
    return needed, owner_path


def _cut_units(tree: Tree, tree_index: int, needed: set[int], max_unit_tokens: int,
               units: list[Unit], children: dict[int | None, list[int]]) -> None:
    """Appends the units of `tree` in depth-first order (children by node ID)."""
    stack: list[tuple[int, int | None, int]] = [(ROOT, None, 0)]
    while stack:
        node_id, parent_key, depth = stack.pop()
        node = tree.nodes[node_id]
        for start in range(0, len(node.token_ids), max_unit_tokens):
            end = min(start + max_unit_tokens, len(node.token_ids))
            unit = Unit(len(units), tree_index, node_id, start, end, parent_key, depth)
            units.append(unit)
            children.setdefault(parent_key, []).append(unit.key)
            parent_key, depth = unit.key, depth + unit.num_tokens
        kids = sorted(c for c in node.children.values() if c in needed)
        stack.extend((kid, parent_key, depth) for kid in reversed(kids))


class _Terms:
    """Accumulates the step-level term arrays while units are cut."""

    def __init__(self, advantages: dict[SessionKey, float]):
        self.advantages = advantages
        self.session_keys: list[SessionKey] = []
        self.session_index: dict[SessionKey, int] = {}
        self.by_unit: dict[int, list[int]] = {}
        self.session, self.path, self.behaviour, self.advantage = [], [], [], []
        self.version: list[int] = []
        self.origin: list[tuple[int, int, int]] = []

    def add_unit(self, tree: Tree, unit: Unit, owner_path: dict[int, int]) -> None:
        node = tree.nodes[unit.node_id]
        if node.sampled_by is None:
            return
        key = (tree.group_id, node.sampled_by)
        if key not in self.advantages or unit.node_id not in owner_path:
            return
        index = self.session_index.setdefault(key, len(self.session_keys))
        if index == len(self.session_keys):
            self.session_keys.append(key)
        ids = self.by_unit.setdefault(unit.key, [])
        # A tree's first token (depth 0) has no token before it to be scored from.
        first = unit.start + 1 if unit.depth == 0 else unit.start
        for offset in range(first, unit.end):
            ids.append(len(self.session))
            self.session.append(index)
            self.path.append(owner_path[unit.node_id])
            self.behaviour.append(node.logprobs[offset])
            self.version.append(node.weight_versions[offset])
            self.advantage.append(self.advantages[key])
            self.origin.append((unit.tree_index, unit.node_id, offset))


def _plan(units: list[Unit], children: dict[int | None, list[int]], max_tokens: int,
          whole: bool = False) -> list[tuple[list[int], set[int]]]:
    """Places units into micro-batches: a whole subtree where it fits (into the current
    micro-batch, else a fresh one), otherwise the unit alone and then its children;
    with `whole`, a subtree that starts with a chain (its unit has at most one child)
    goes into a fresh micro-batch whole, however long.
    Returns (unit keys in depth-first order, keys trained there) per micro-batch."""
    subtree_tokens = [u.num_tokens for u in units]
    for unit in reversed(units):
        if unit.parent is not None:
            subtree_tokens[unit.parent] += subtree_tokens[unit.key]
    plans: list[tuple[list[int], set[int]]] = []
    present: set[int] = set()
    trained: set[int] = set()
    size = 0

    def ancestors_missing(key: int) -> list[int]:
        missing, parent = [], units[key].parent
        while parent is not None and parent not in present:
            missing.append(parent)
            parent = units[parent].parent
        return missing

    def add(keys: list[int]) -> None:
        nonlocal size
        for key in ancestors_missing(keys[0]) + keys:
            if key not in present:
                present.add(key)
                size += units[key].num_tokens
        trained.update(keys)

    def emit() -> None:
        nonlocal size
        if trained:
            plans.append((sorted(present), set(trained)))
        present.clear()
        trained.clear()
        size = 0

    def subtree(key: int) -> list[int]:
        keys, stack = [], [key]
        while stack:
            keys.append(stack.pop())
            stack.extend(reversed(children.get(keys[-1], [])))
        return keys

    stack = list(reversed(children.get(None, [])))
    while stack:
        key = stack.pop()
        missing = sum(units[k].num_tokens for k in ancestors_missing(key))
        if size + missing + subtree_tokens[key] <= max_tokens:
            add(subtree(key))
            continue
        if (units[key].depth + subtree_tokens[key] <= max_tokens
                or (whole and len(children.get(key, [])) <= 1)):
            emit()
            add(subtree(key))
            continue
        if size + missing + units[key].num_tokens > max_tokens:
            emit()
        add([key])
        stack.extend(reversed(children.get(key, [])))
    emit()
    return plans


def _materialize(trees: list[Tree], units: list[Unit], keys: list[int], trained: set[int],
                 terms: _Terms) -> MicroBatch:
    """The tensors of one micro-batch from its units (depth-first order)."""
    token_ids, position_ids, unit_index = [], [], []
    first_index, last_index = {}, {}
    for index, key in enumerate(keys):
        unit = units[key]
        first_index[key] = len(token_ids)
        token_ids += trees[unit.tree_index].nodes[unit.node_id].token_ids[unit.start:unit.end]
        position_ids += range(unit.depth, unit.depth + unit.num_tokens)
        unit_index += [index] * unit.num_tokens
        last_index[key] = len(token_ids) - 1
    local = {key: index for index, key in enumerate(keys)}
    ancestors = torch.zeros(len(keys), len(keys), dtype=torch.bool)
    for key in keys:
        walk = key
        while walk is not None:
            ancestors[local[key], local[walk]] = True
            walk = units[walk].parent
    term_ids, token_index, predictor_index = [], [], []
    for key in keys:
        if key not in trained:
            continue
        unit = units[key]
        for term in terms.by_unit.get(key, []):
            offset = terms.origin[term][2]
            index = first_index[key] + offset - unit.start
            term_ids.append(term)
            token_index.append(index)
            predictor_index.append(index - 1 if offset > unit.start else last_index[unit.parent])
    return MicroBatch(
        token_ids=torch.tensor(token_ids), position_ids=torch.tensor(position_ids),
        unit_keys=keys, unit_parents=[units[k].parent for k in keys],
        unit_index=torch.tensor(unit_index), unit_ancestors=ancestors,
        term_ids=torch.tensor(term_ids, dtype=torch.long),
        term_token_index=torch.tensor(token_index, dtype=torch.long),
        term_predictor_index=torch.tensor(predictor_index, dtype=torch.long),
        num_trained_tokens=sum(units[k].num_tokens for k in trained))
