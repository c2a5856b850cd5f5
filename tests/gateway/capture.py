"""Reading one call back out of a tree, for exactness checks."""

from __future__ import annotations

from dataclasses import dataclass

from undertow.gateway.trees.tree import Tree


@dataclass
class Captured:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    trainable: list[bool]
    branch: str | None
    meta: dict


def captured(tree: Tree, call_id: str) -> Captured:
    call = next(call for call in tree.calls if call.call_id == call_id)
    token_ids, logprobs, versions, trainable = [], [], [], []
    for node_id in tree.path(call.leaf):
        node = tree.nodes[node_id]
        token_ids += node.token_ids
        logprobs += node.logprobs
        versions += node.weight_versions
        trainable += [node.trainable] * len(node.token_ids)
    num_prompt = len(token_ids) - call.num_completion_tokens
    return Captured(token_ids[:num_prompt], token_ids[num_prompt:], logprobs[num_prompt:],
                    versions[num_prompt:], trainable, call.branch, call.meta)


def calls_of(tree: Tree, session_id: str) -> list[str]:
    return [call.call_id for call in tree.calls if call.session_id == session_id]
