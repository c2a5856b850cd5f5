"""One scaffold call, whatever its API: prompt IDs -> engine pool -> parsed output ->
recorded into the group's tree, written ahead, before the reply is finished (docs/design.md,
"From a scaffold's HTTP call to the tree"). Each API module turns its request into a
`CallRequest` and formats what `CallRunner.stream` yields; `CallRunner` composes
`sampler.ChoiceSampler` and `call_record.CallRecorder`, whose values are in `call_types.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

from undertow.gateway.engine_pool.pool import EnginePool
from undertow.gateway.engines.protocol import EngineRejected, SamplingParams
from undertow.gateway.errors import (
    BadRequest,
    Busy,
    ContextTooLong,
    PoolBusy,
    PoolUnavailable,
    Unavailable,
)
from undertow.gateway.front.call_record import CallRecorder
from undertow.gateway.front.call_types import (
    CallRequest,
    Choice,
    Delta,
    Outcome,
    Sampled,
)
from undertow.gateway.front.sampler import ChoiceSampler, StopTrimmer, new_call_id
from undertow.gateway.front.sessions import Session, SessionRegistry
from undertow.gateway.front.store import TreeStore
from undertow.gateway.front.tokentruth import (
    TOKEN_TRUTH_POLICIES,
    VERBATIM,
    InFlightCall,
    Prompt,
    build_prompt,
)
from undertow.gateway.front.toolparsers import create_parser
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.render import Renderer

__all__ = ["CallRequest", "CallRunner", "Choice", "Delta", "Outcome", "Sampled",
           "SamplingParams", "StopTrimmer", "api_error_of", "model_vocab_size"]


def model_vocab_size(model_dir: Path) -> int | None:
    """The rows of the model's input embedding: `vocab_size` in its `config.json` (a
    multimodal model's `text_config`); None when it states none."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    value = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(value) if value else None


class CallRunner:
    """Runs calls for every API against one pool, store, renderer and session registry.

    A client's prompt token IDs must lie in [0, `num_token_ids`): under the tokenizer's
    size and the model's `vocab_size` (`model_vocab_size`), which may be smaller. SGLang
    0.5.23 does not check `input_ids` (`tokenizer_manager._validate_one_request`): an ID
    its embedding does not hold takes the whole server down, so none may leave the gateway.
    Where the tokenizer holds more IDs than the embedding, a rendered chat prompt is
    checked too (`_check_rendered_ids`); elsewhere the tokenizer cannot produce one.
    """

    def __init__(self, *, pool: EnginePool, store: TreeStore, renderer: Renderer,
                 sessions: SessionRegistry, metrics: GatewayMetrics, context_length: int,
                 default_max_tokens: int, tool_parser: str, token_truth: str = VERBATIM,
                 vocab_size: int | None = None):
        if token_truth not in TOKEN_TRUTH_POLICIES:
            raise ValueError(f"token_truth={token_truth!r}: choose one of "
                             f"{TOKEN_TRUTH_POLICIES}")
        self.token_truth = token_truth
        self.pool, self.store, self.renderer, self.sessions = pool, store, renderer, sessions
        self.metrics = metrics
        self.context_length = context_length
        num_tokenizer_ids = renderer.tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_token_ids = min(num_tokenizer_ids, vocab_size or sys.maxsize)
        self._embeds_every_id = self.num_token_ids == num_tokenizer_ids
        self.default_max_tokens = default_max_tokens
        self.tool_parser = tool_parser
        create_parser(tool_parser)
        self.sampler = ChoiceSampler(pool=pool, renderer=renderer, metrics=metrics,
                                     tool_parser=tool_parser)
        self.recorder = CallRecorder(store=store, renderer=renderer, sessions=sessions,
                                     metrics=metrics)

    def prompt(self, session: Session, request: CallRequest) -> Prompt:
        if request.prompt_ids is not None:
            return Prompt(list(request.prompt_ids), None, None, 0, (), "")
        assert request.messages is not None  # a chat call (`CallRequest`: one or the other)
        # a head's path IDs are its own (`Head.token_ids`, shared, never changed); the
        # tree is read only for a head that did not keep them (an older one, a restart)
        prompt = build_prompt(self.renderer.with_kwargs(request.template_kwargs),
                              request.messages, request.tools, session.heads,
                              self.store.tree(session.group).path_token_ids,
                              policy=self.token_truth,
                              in_flight=session.calls_in_flight)
        self.metrics.token_truth.inc(outcome="hit" if prompt.token_truth else "full_render")
        if prompt.branch:
            self.metrics.branches.inc(reason=prompt.branch)
        return prompt

    def max_new_tokens(self, prompt: Prompt, sampling: SamplingParams) -> int:
        num_prompt = len(prompt.token_ids)
        room = self.context_length - num_prompt
        wanted = sampling.max_new_tokens
        if room <= 0 or (wanted is not None and wanted > room):
            raise ContextTooLong(
                f"This model's maximum context length is {self.context_length} tokens. However, "
                f"you requested {num_prompt + (wanted or 0)} tokens ({num_prompt} in the "
                f"messages, {wanted or 0} in the completion). Please reduce the length of the "
                "messages or completion.", param="messages")
        return min(wanted if wanted is not None else self.default_max_tokens, room)

    async def complete(self, session: Session, request: CallRequest) -> Outcome:
        """The recorded `Outcome` of a call whose reply is not streamed (its deltas come
        when the engine is done: `ChoiceSampler.sample_all`'s `live`)."""
        outcome = None
        async for item in self.stream(session, request, live=False):
            outcome = item if isinstance(item, Outcome) else outcome
        assert outcome is not None  # `stream` ends with one, or raises
        return outcome

    async def stream(self, session: Session, request: CallRequest, live: bool = True
                     ) -> AsyncGenerator[Delta | Outcome, None]:
        """`Delta`s as sampled, then exactly one `Outcome`, yielded only once every choice
        is in the tree and on disk: the API sends its last byte after it, so a delivered
        reply is always recorded. An SDK retry (same fingerprint, retry header > 0) is
        answered from its original (`_earlier_reply`), never generated or recorded twice."""
        replay = await self._earlier_reply(session, request)
        if replay is not None:
            for item in replay:
                yield item
            return
        in_flight = asyncio.get_running_loop().create_future()
        if request.fingerprint:
            session.in_flight.setdefault(request.fingerprint, in_flight)
        try:
            async for item in self._generate(session, request, live):
                if isinstance(item, Outcome) and request.fingerprint:
                    in_flight.set_result(session.replies.get(request.fingerprint))
                yield item
        finally:
            if not in_flight.done():
                in_flight.set_result(None)
            if session.in_flight.get(request.fingerprint) is in_flight:
                del session.in_flight[request.fingerprint]

    @staticmethod
    async def _earlier_reply(session: Session, request: CallRequest) -> list | None:
        """For an SDK retry: the reply its original produced, waiting for the original
        when it is still generating. None when there is none (the original failed or
        was abandoned, or this is no retry): then the retry is generated."""
        if not (request.is_retry and request.fingerprint):
            return None
        original = session.in_flight.get(request.fingerprint)
        if original is not None and request.fingerprint not in session.replies:
            await asyncio.shield(original)
        return session.replies.get(request.fingerprint)

    async def _generate(self, session: Session, request: CallRequest, live: bool
                        ) -> AsyncGenerator[Delta | Outcome, None]:
        self._check_prompt_ids(request)
        prompt = self.prompt(session, request)
        self._check_rendered_ids(prompt)
        max_new_tokens = self.max_new_tokens(prompt, request.sampling)
        started_s, call_id = time.time(), new_call_id()
        replay: list[Delta | Outcome] = []
        results: list[Sampled] = []
        with _in_flight(session, prompt, call_id, started_s):
            items = self.sampler.sample_all(session.session_id, request, prompt,
                                            max_new_tokens, call_id, live)
            async with contextlib.aclosing(items):
                try:
                    async for item in items:
                        if isinstance(item, Sampled):
                            results.append(item)
                            continue
                        replay.append(item)
                        yield item
                except Exception as error:
                    raise api_error_of(error) from None
            outcome = await self.recorder.record(session, request, prompt, results, started_s,
                                                 live)
        replay.append(outcome)
        if request.fingerprint:
            session.remember_reply(request.fingerprint, replay)
        yield outcome

    def _check_prompt_ids(self, request: CallRequest) -> None:
        if request.prompt_ids is None:
            return
        limit = self.num_token_ids
        if not request.prompt_ids or not all(
                isinstance(t, int) and 0 <= t < limit for t in request.prompt_ids):
            raise BadRequest(f"prompt token IDs must be a non-empty list of integers in "
                             f"[0, {limit}) (the IDs both the tokenizer and the model's "
                             "embedding hold)", param="prompt")


    def _check_rendered_ids(self, prompt: Prompt) -> None:
        """A chat prompt's IDs, where the tokenizer holds IDs the embedding does not."""
        if self._embeds_every_id:   # decided once: no rendered ID can be out of range
            return
        highest = max(prompt.token_ids, default=0)
        if highest >= self.num_token_ids:
            raise BadRequest(
                f"the prompt renders to token ID {highest} "
                f"({self.renderer.id_to_token(highest)!r}), which the tokenizer has but the "
                f"model's embedding ({self.num_token_ids} rows, config.json vocab_size) does "
                "not: no engine can take it. Leave that text out of the messages, or serve a "
                "model whose embedding holds the whole tokenizer", param="messages")


@contextlib.contextmanager
def _in_flight(session: Session, prompt: Prompt, call_id: str, started_s: float
               ) -> Iterator[None]:
    """A chat call (a prompt with messages) counts among its session's `calls_in_flight`
    (which later calls are labelled against, `tokentruth.py`) from its start until it is
    recorded or abandoned."""
    if prompt.messages is None:
        yield
        return
    call = InFlightCall(call_id, prompt.message_keys, prompt.tools_key, prompt.messages,
                        prompt.token_ids, started_s)
    session.calls_in_flight.append(call)
    try:
        yield
    finally:
        session.calls_in_flight.remove(call)


def api_error_of(error: BaseException) -> BaseException:
    """Pool and engine errors as the API errors a scaffold gets (400, 429 with
    Retry-After, 503); others unchanged. The one place a call's errors cross from the
    engine pool to the API (`errors.py` draws both)."""
    if isinstance(error, EngineRejected):
        return BadRequest(f"the engine refused the request: {error}")
    if isinstance(error, PoolBusy):
        return Busy(str(error), retry_after_s=error.retry_after_s)
    if isinstance(error, PoolUnavailable):
        return Unavailable(str(error) or "no engine is available; retry later")
    return error
