"""Recording a call: its sampled choices -> the group's tree and log -> the session's heads
(docs/design.md, "From a scaffold's HTTP call to the tree", step 9). `CallRunner` calls
`CallRecorder.record` once a call's choices are sampled; its `Outcome` is what the API
formats.
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any

from undertow.gateway.engines.protocol import SamplingParams
from undertow.gateway.errors import GatewayError
from undertow.gateway.front.call_types import CallRequest, Choice, Outcome, Sampled
from undertow.gateway.front.head_replay import head_record, message_of_events
from undertow.gateway.front.sessions import Session, SessionRegistry
from undertow.gateway.front.store import TreeStore
from undertow.gateway.front.token_path import TokenPath
from undertow.gateway.front.tokentruth import Head, Prompt
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.render import Renderer
from undertow.gateway.trees.errors import TreeError


class CallRecorder:
    """Records calls into one store's trees and one registry's sessions."""

    def __init__(self, *, store: TreeStore, renderer: Renderer, sessions: SessionRegistry,
                 metrics: GatewayMetrics) -> None:
        self.store, self.renderer, self.sessions = store, renderer, sessions
        self.metrics = metrics
        self._lost: set[str] = set()  # sessions whose held records the store dropped

    async def record(self, session: Session, request: CallRequest, prompt: Prompt,
                     results: list[Sampled], started_s: float, live: bool = False) -> Outcome:
        """Applies the choices' records to the tree inside one `Tree.transaction` and
        writes their lines, all or none: a failed write undoes the tree's change and
        raises `StoreUnavailable` (a 503), and no head is left. A `live` (streamed) call's
        lines are held instead (`_records_lost` if the store drops them). Then leaves one
        head per choice, choice 0's last, so that a scaffold continuing choice 0 extends
        the newest head with no branch (`HeadReplay` keeps that order after a restart).
        The prompt's IDs are never changed: the pool, the engine request and a running
        migration may hold them."""
        tree = self.store.tree(session.group)
        num_prompt = len(prompt.token_ids)
        head = (head_record(prompt, session.heads, request.parses_tools)
                if request.messages is not None else None)
        results = sorted(results, key=lambda item: item.index)
        extends_leaf = None if session.session_id in self._lost else prompt.extends_leaf
        on_lost = functools.partial(self._records_lost, session) if live else None
        try:
            with tree.transaction():
                records = [self._add_call(tree, session, request, prompt, result, head,
                                          started_s, extends_leaf) for result in results]
                written = self.store.submit(session.group, *(r.to_json() for r in records),
                                            on_lost=on_lost)
        except TreeError as error:   # the trees' own root, met here: the gateway's 500
            raise GatewayError(f"the call does not fit its group's tree: {error}") from error
        leaves = [call.leaf for call in tree.calls[-len(results):]]
        choices = [self._choice(result, request) for result in results]
        if request.messages is not None and not session.closed:  # closed while it ran
            for choice, leaf in reversed(list(zip(choices, leaves, strict=True))):
                self._leave_head(session, request, prompt, choice, leaf, num_prompt,
                                 started_s)
        session.num_calls += 1
        await written  # a done future (`flush` mode) is awaited without a loop turn
        self._count(request, num_prompt, choices, results, started_s)
        return Outcome(choices, num_prompt, max(result.cached_tokens for result in results))

    def _records_lost(self, session: Session, reason: str) -> None:
        """The store dropped this session's held records: it is an infra failure, and
        its heads (and a running call's path) hang on nodes its tree no longer has."""
        session.note_infra_error(reason)
        session.heads.clear()
        self._lost.add(session.session_id)

    def _count(self, request: CallRequest, num_prompt: int, choices: list[Choice],
               results: list[Sampled], started_s: float) -> None:
        self.metrics.prompt_tokens.inc(num_prompt, api=request.api)
        self.metrics.completion_tokens.inc(sum(len(c.token_ids) for c in choices),
                                           api=request.api)
        first = [r.first_token_s for r in results if r.first_token_s]
        if first:
            self.metrics.time_to_first_token_s.observe(min(first) - started_s, api=request.api)

    @staticmethod
    def _add_call(tree, session: Session, request: CallRequest, prompt: Prompt, result: Sampled,
                  head: dict | None, started_s: float, extends_leaf: int | None):
        branch = prompt.branch if result.index == 0 else "sample"
        meta = {"api": request.api, "model": request.model,
                "finish_reason": result.finish_reason, "sampling": sampling_meta(result.sampling),
                "cached_tokens": result.cached_tokens, "extends": prompt.extends,
                "token_truth": prompt.token_truth, "honours_seeds": result.honours_seeds,
                **({"head": head} if head else {}),
                **({"storage_tokens": result.storage_tokens} if result.storage_tokens else {}),
                "timings": {"start_s": started_s, "first_token_s": result.first_token_s,
                            "end_s": time.time()}}
        return tree.add_call(result.call_id, session.session_id, prompt.token_ids,
                             result.token_ids, result.logprobs, result.weight_versions,
                             branch=branch, meta=meta, extends_leaf=extends_leaf)

    def _leave_head(self, session: Session, request: CallRequest, prompt: Prompt,
                    choice: Choice, leaf: int, num_prompt: int, started_s: float) -> None:
        """The head this choice leaves for the session's next call, with its path's IDs:
        the prompt's `TokenPath` extended by the completion, sharing the prompt's chunks
        (so it costs the completion, not the history; nothing is read out of the tree
        or copied, and the prompt the pool holds is not changed)."""
        token_ids = TokenPath.of(prompt.token_ids).extend(choice.token_ids)
        ids_json = (prompt.token_ids_json.extend(choice.token_ids)
                    if prompt.token_ids_json is not None else None)
        session.add_head(Head(choice.call_id, prompt.message_keys, prompt.tools_key,
                              choice.message, leaf, num_prompt,
                              self.renderer.closing_text(choice.token_ids), prompt.messages,
                              ids_json, token_ids,
                              self.renderer.next_turn_start(choice.token_ids), started_s),
                         self.sessions.num_heads)

    @staticmethod
    def _choice(result: Sampled, request: CallRequest) -> Choice:
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if request.messages is not None:  # the events parsed while streaming
            message = message_of_events(result.events, lambda: f"call_{secrets.token_hex(12)}")
        return Choice(result.index, result.call_id, message, result.text,
                      result.token_ids, result.logprobs, result.weight_versions,
                      result.finish_reason)


def sampling_meta(params: SamplingParams) -> dict[str, Any]:
    """A choice's sampling parameters as its call's meta records them: the ones a scaffold
    can set, with the seed the choice was sampled with (replay reads `stop`, `sampling_seed`
    and a forcing `json_schema` back, `head_replay.py`, `toolparsers.replay_parser`)."""
    meta: dict[str, Any] = {"max_new_tokens": params.max_new_tokens,
                            "temperature": params.temperature, "top_p": params.top_p,
                            "top_k": params.top_k}
    if params.stop:
        meta["stop"] = list(params.stop)
    meta["sampling_seed"] = params.sampling_seed
    for name, value in (("json_schema", params.json_schema), ("regex", params.regex),
                        ("ebnf", params.ebnf), ("structural_tag", params.structural_tag)):
        if value is not None:
            meta[name] = value
    return meta
