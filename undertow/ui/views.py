"""What each page of the viewer shows, as JSON computed from a run's files (`runs.py`):
`step_view`, `session_view` (a page of calls at a time) and `tree_view` (docs/ui.md).

Token text comes from the run's tokenizer (`Decoder`); without one, token IDs stand in.
A call's prompt shares its first tokens with the session's previous call along the same
tree nodes, so its new part is found by comparing node IDs, not tokens: a page costs its
own calls' new tokens. That size (`call_prompt`) is what both pages call "new prompt
tokens".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from undertow.gateway.trees.tree import Call, Tree
from undertow.learner.advantages import group_advantages
from undertow.learner.config import AdvantageConfig
from undertow.ui.runs import Decoder, NotFoundError, RunFolder

CALLS_PER_PAGE = 10
PREVIEW_CHARS = 48
OUTCOME_KEYS = ("cause", "reward_source", "resolved", "grade_reason", "duration_s", "error",
                "exit_code", "tests", "partial_credit", "instance_id")


def advantage_config(config: dict[str, Any]) -> AdvantageConfig:
    """The run's `advantages` section (keys this version does not know are left out)."""
    section = config.get("advantages") or {}
    known = {f.name for f in dataclasses.fields(AdvantageConfig)}
    return AdvantageConfig(**{k: v for k, v in section.items() if k in known})


@dataclass(frozen=True)
class CallPrompt:
    """Where a call's new prompt tokens lie on its path: the path's node IDs, its number
    of tokens (prompt and reply), of prompt tokens, and of tokens it shares, node for
    node, with the session's previous call's path."""

    path: list[int]
    num_tokens: int
    num_prompt_tokens: int
    num_shared: int

    @property
    def num_new_prompt_tokens(self) -> int:
        """The prompt tokens the session's previous call did not have: what this call
        sent anew (the task for a first call, tool results and messages after)."""
        return self.num_prompt_tokens - min(self.num_shared, self.num_prompt_tokens)


def call_prompt(tree: Tree, call: Call, previous: Call | None) -> CallPrompt:
    """`call`'s prompt against `previous`, the session's call before it (None: first).
    Both the session page (per call) and the step page (per session) count new prompt
    tokens with this. It is not `Call.num_prompt_tokens`, the tokens the call added to
    the group's tree: a prompt that another session already sent adds none there."""
    path = tree.path(call.leaf)
    previous_path = tree.path(previous.leaf) if previous else []
    num_tokens = sum(len(tree.nodes[node_id].token_ids) for node_id in path)
    return CallPrompt(path, num_tokens, num_tokens - call.num_completion_tokens,
                      _num_shared_tokens(tree, path, previous_path))


def session_calls(tree: Tree, session_id: str) -> list[Call]:
    return [c for c in tree.calls if c.session_id == session_id]


def session_row(tree: Tree, session_id: str, advantage: float | None) -> dict[str, Any]:
    paths = tree.sessions[session_id]
    calls = session_calls(tree, session_id)
    return {"session": session_id, "reward": paths.reward, "closed": paths.closed,
            "cause": paths.meta.get("cause", "closed" if paths.closed else "open"),
            "duration_s": paths.meta.get("duration_s", _calls_duration_s(calls)),
            "num_calls": len(calls),
            "num_new_prompt_tokens": sum(
                call_prompt(tree, call, calls[i - 1] if i else None).num_new_prompt_tokens
                for i, call in enumerate(calls)),
            "num_completion_tokens": sum(c.num_completion_tokens for c in calls),
            "advantage": advantage}


def group_view(run: RunFolder, group: str) -> dict[str, Any]:
    tree = run.tree(group)
    advantages: dict[str, float] = {}
    if tree.sessions and all(p.closed for p in tree.sessions.values()):
        advantages = group_advantages(tree, advantage_config(run.config()))
    return {"group": group, "num_unique_tokens": tree.num_unique_tokens,
            "num_calls": len(tree.calls),
            "sessions": [session_row(tree, sid, advantages.get(sid))
                         for sid in sorted(tree.sessions)]}


def step_view(run: RunFolder, step: int) -> dict[str, Any]:
    records, _ = run.metrics()
    record = next((r for r in records if r.get("step") == step), None)
    if record is None:
        raise NotFoundError(f"run {run.name} has no step {step} in its metrics")
    group_ids, source = run.step_groups(step)
    known = set(run.groups())
    return {"run": run.name, "step": step, "metrics": record, "groups_source": source,
            "groups": [group_view(run, g) for g in group_ids if g in known],
            "missing_groups": [g for g in group_ids if g not in known]}


def session_view(run: RunFolder, group: str, session_id: str, offset: int = 0,
                 limit: int = CALLS_PER_PAGE) -> dict[str, Any]:
    tree = run.tree(group)
    if session_id not in tree.sessions:
        raise NotFoundError(f"group {group} has no session {session_id!r}")
    decoder = run.decoder()
    calls = session_calls(tree, session_id)
    page = []
    for index in range(offset, min(offset + limit, len(calls))):
        previous = calls[index - 1] if index else None
        page.append(call_view(tree, calls[index], previous, index, decoder))
    paths = tree.sessions[session_id]
    details = paths.meta.get("details") or {}
    return {"run": run.name, "group": group, "session": session_id,
            "reward": paths.reward, "closed": paths.closed,
            "outcome": {k: paths.meta[k] for k in OUTCOME_KEYS if k in paths.meta},
            "diff": details.get("diff", "") if isinstance(details, dict) else "",
            "num_calls": len(calls), "offset": offset, "limit": limit, "calls": page,
            "scaffold_messages": run.scaffold_messages(group, session_id) if offset == 0 else [],
            "decoded": decoder.tokenizer is not None}


def call_view(tree: Tree, call: Call, previous: Call | None, index: int,
              decoder: Decoder) -> dict[str, Any]:
    """One call: the prompt tokens new since `previous`, and the reply token by token."""
    prompt = call_prompt(tree, call, previous)
    num_new = prompt.num_new_prompt_tokens
    # Only the tail past the shared part is read: a page costs its calls' new tokens, not
    # their context.
    token_ids, logprobs, versions = _path_tail(
        tree, prompt.path, num_new + call.num_completion_tokens)
    new_prompt, reply = token_ids[:num_new], token_ids[num_new:]
    reply_versions = versions[num_new:]
    rewrote = previous is not None and prompt.num_shared < tree.path_length(previous.leaf)
    return {"index": index, "call_id": call.call_id, "branch": call.branch,
            "labels": _labels(call, rewrote, reply_versions),
            "num_prompt_tokens": prompt.num_prompt_tokens, "num_new_prompt_tokens": num_new,
            "prompt_text": decoder.text(new_prompt),
            "reply": {"token_ids": reply, "pieces": decoder.pieces(reply),
                      "logprobs": logprobs[num_new:], "weight_versions": reply_versions},
            "finish_reason": call.meta.get("finish_reason"),
            "timings": call.meta.get("timings"), "api": call.meta.get("api")}


def tree_view(run: RunFolder, group: str) -> dict[str, Any]:
    tree = run.tree(group)
    decoder = run.decoder()
    through: dict[int, list[str]] = {}
    for session_id, paths in sorted(tree.sessions.items()):
        for node_id in {n for leaf in paths.leaves for n in tree.path(leaf)}:
            through.setdefault(node_id, []).append(session_id)
    nodes = [{"id": node.node_id, "parent": node.parent, "num_tokens": len(node.token_ids),
              "sampled_by": node.sampled_by, "sessions": through.get(node.node_id, []),
              "preview": decoder.text(node.token_ids[:24])[:PREVIEW_CHARS]}
             for node in tree.nodes.values() if node.parent is not None]
    return {"run": run.name, "group": group, "nodes": nodes,
            "sessions": {sid: {"reward": p.reward, "closed": p.closed}
                         for sid, p in sorted(tree.sessions.items())},
            "num_unique_tokens": tree.num_unique_tokens}


def _path_tail(tree: Tree, path: list[int],
               num_tokens: int) -> tuple[list[int], list[float | None], list[int]]:
    """The last `num_tokens` tokens of `path`: IDs, logprobs (None for prompt tokens),
    weight versions; read from the leaf up, so the cost is the tail's, not the path's."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for node_id in reversed(path):
        if len(token_ids) >= num_tokens:
            break
        node = tree.nodes[node_id]
        token_ids[:0], logprobs[:0] = node.token_ids, node.logprobs
        versions[:0] = node.weight_versions
    cut = len(token_ids) - num_tokens
    return (token_ids[cut:], [None if v != v else v for v in logprobs[cut:]],  # NaN: prompt
            versions[cut:])


def _num_shared_tokens(tree: Tree, path: list[int], previous_path: list[int]) -> int:
    num_shared = 0
    for node_id, previous_id in zip(path, previous_path, strict=False):
        if node_id != previous_id:
            break
        num_shared += len(tree.nodes[node_id].token_ids)
    return num_shared


def _labels(call: Call, rewrote: bool, reply_versions: list[int]) -> list[str]:
    labels = [call.branch] if call.branch else []
    if rewrote and not labels:
        labels.append("rewrite")
    versions = sorted({v for v in reply_versions if v >= 0})
    if len(versions) > 1:
        labels.append("weights changed mid-reply: " + " → ".join(f"v{v}" for v in versions))
    return labels


def _calls_duration_s(calls: list[Call]) -> float | None:
    timings = [c.meta.get("timings") or {} for c in calls]
    starts = [t["start_s"] for t in timings if t.get("start_s")]
    ends = [t["end_s"] for t in timings if t.get("end_s")]
    return max(ends) - min(starts) if starts and ends else None
