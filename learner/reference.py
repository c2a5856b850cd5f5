"""The flat reference: the loss of losses.py computed one sample at a time, untreed, for the
tests (tree = flat, loss and every gradient) and benchmarks/learner.py. A sample is one
sequence run alone (causal mask, positions 0..L-1): `mode="session"`, each selected path of
each session (the computation that defines the objective); `mode="call"`, each recorded
call (Agent Lightning's transition mode). A sample scores the tokens of its session that no
earlier sample of it scored, so each trainable token counts once. Only f_t
(`losses.token_terms`) is shared with the packed path: normalisers and sequence masks are
computed here from the samples' own counts and scores.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from undertow.gateway.trees.tree import Tree
from undertow.learner.config import LossConfig
from undertow.learner.losses import token_terms
from undertow.learner.model import PolicyModel
from undertow.learner.packing import SessionKey, selected_leaves


@dataclass
class FlatSample:
    """One sequence and the tokens it trains: `scored` are positions (> 0) into
    `token_ids`; `path_index[k]` is the first selected path of the session holding
    scored token k."""

    session: SessionKey
    token_ids: torch.Tensor     # (L,) long
    scored: torch.Tensor        # (n,) long
    behaviour: torch.Tensor     # (n,) float64
    path_index: list[int]
    advantage: float
    versions: torch.Tensor      # (n,) long, the weight version that sampled each


def _path_positions(tree: Tree, leaf: int) -> list[tuple[int, int]]:
    return [(node_id, offset) for node_id in tree.path(leaf)
            for offset in range(len(tree.nodes[node_id].token_ids))]


def flat_samples(trees: list[Tree], advantages: dict[SessionKey, float], mode: str = "session",
                 max_paths_per_session: int | None = None) -> list[FlatSample]:
    """The step's samples, in session order (see the module docstring)."""
    if mode not in ("session", "call"):
        raise ValueError(f"mode must be 'session' or 'call', got {mode!r}")
    samples = []
    for tree in trees:
        for session_id in tree.sessions:
            key = (tree.group_id, session_id)
            if key not in advantages:
                continue
            leaves = selected_leaves(tree, session_id, max_paths_per_session)
            first_path: dict[int, int] = {}
            for path_index, leaf in enumerate(leaves):
                for node_id in tree.path(leaf):
                    first_path.setdefault(node_id, path_index)
            if mode == "session":
                sequences = [(leaf, 0) for leaf in leaves]
            else:
                sequences = [(call.leaf, call.num_completion_tokens) for call in tree.calls
                             if call.session_id == session_id]
            seen: set[tuple[int, int]] = set()
            for leaf, num_completion in sequences:
                positions = _path_positions(tree, leaf)
                start = len(positions) - num_completion if mode == "call" else 1
                scored, behaviour, path_index, versions = [], [], [], []
                for index in range(max(start, 1), len(positions)):
                    node_id, offset = positions[index]
                    node = tree.nodes[node_id]
                    if (node.sampled_by != session_id or node_id not in first_path
                            or (node_id, offset) in seen):
                        continue
                    seen.add((node_id, offset))
                    scored.append(index)
                    behaviour.append(node.logprobs[offset])
                    versions.append(node.weight_versions[offset])
                    path_index.append(first_path[node_id])
                if scored:
                    samples.append(FlatSample(
                        key, torch.tensor(tree.path_token_ids(leaf)), torch.tensor(scored),
                        torch.tensor(behaviour, dtype=torch.float64), path_index,
                        advantages[key], torch.tensor(versions, dtype=torch.long)))
    return samples


def flat_weights(samples: list[FlatSample], config: LossConfig) -> list[torch.Tensor]:
    """Per sample, the (n,) normaliser weight of each scored token (losses.py's table)."""
    per_session: dict[SessionKey, int] = defaultdict(int)
    per_path: dict[tuple[SessionKey, int], int] = defaultdict(int)
    for sample in samples:
        per_session[sample.session] += len(sample.path_index)
        for path in sample.path_index:
            per_path[(sample.session, path)] += 1
    num_sessions = len(per_session)
    num_tokens = sum(per_session.values())
    paths_of = defaultdict(int)
    for session, _ in per_path:
        paths_of[session] += 1
    weights = []
    for sample in samples:
        s = sample.session
        if config.name == "token_mean":
            values = [1.0 / num_tokens] * len(sample.path_index)
        elif config.name == "grpo":
            values = [1.0 / (num_sessions * per_session[s])] * len(sample.path_index)
        elif config.name == "dr_grpo":
            values = [1.0 / (num_sessions * config.dr_grpo_num_tokens)] * len(sample.path_index)
        else:
            values = [1.0 / (num_sessions * paths_of[s] * per_path[(s, p)])
                      for p in sample.path_index]
        weights.append(torch.tensor(values, dtype=torch.float64))
    return weights


def flat_sequence_keep(policy: PolicyModel, samples: list[FlatSample], config: LossConfig
                       ) -> dict[SessionKey, bool]:
    """Per session, whether `config.sequence_mask` keeps it: the geometric mean of the
    train/sample ratios of all its scored tokens, from a pass without gradient."""
    log_ratio_sums: dict[SessionKey, float] = defaultdict(float)
    num_tokens: dict[SessionKey, int] = defaultdict(int)
    with torch.no_grad():
        for sample in samples:
            logprobs = policy.score_path(sample.token_ids, sample.scored).logprobs
            log_ratio_sums[sample.session] += float((logprobs.double() - sample.behaviour).sum())
            num_tokens[sample.session] += len(sample.scored)
    return {session: config.sequence_mask_low
            <= math.exp(log_ratio_sums[session] / num_tokens[session])
            <= config.sequence_mask_high for session in num_tokens}


def flat_loss(policy: PolicyModel, samples: list[FlatSample], config: LossConfig,
              reference: PolicyModel | None = None, backward: bool = True,
              weight_version: int | None = None) -> float:
    """The step's loss, one sample at a time; with `backward`, each sample's share is
    backpropagated at once (gradients accumulate in the parameters' `.grad`).
    `weight_version`: the version trained, for `max_token_version_gap` (None: gap 0)."""
    total = 0.0
    kept = (flat_sequence_keep(policy, samples, config) if config.sequence_mask != "none"
            else None)
    for sample, weights in zip(samples, flat_weights(samples, config), strict=True):
        scores = policy.score_path(sample.token_ids, sample.scored,
                                   with_entropy=bool(config.entropy_coef))
        ref_logprobs = None
        if config.kl_coef and reference is not None:
            with torch.no_grad():
                ref_logprobs = reference.score_path(sample.token_ids, sample.scored).logprobs
        advantages = torch.full_like(sample.behaviour, sample.advantage)
        keep = None if kept is None else torch.full(sample.behaviour.shape, kept[sample.session])
        gap = torch.zeros_like(sample.versions)
        if weight_version is not None:
            gap = torch.where(sample.versions >= 0, weight_version - sample.versions, 0)
        terms, _ = token_terms(config, scores.logprobs, sample.behaviour, advantages,
                               ref_logprobs, scores.entropy, keep, gap.clamp(min=0))
        loss = (weights.to(terms.dtype) * terms).sum()
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total
