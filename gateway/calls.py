"""One scaffold call, whatever its API: prompt IDs -> engine pool -> parsed output ->
recorded into the group's tree, written ahead, before the reply is finished.

Each API module translates its request into a `CallRequest` (internal chat form or
raw prompt IDs), iterates `CallRunner.stream`, and formats what it yields:
`Delta`s while the engine samples, then exactly one `Outcome`, which is yielded
only after every choice is in the tree and on disk. The API sends its last byte
after it has the `Outcome`, so a delivered reply is always recorded.

A retry of a call (same request fingerprint, SDK retry header > 0) is never generated
or recorded twice: if the original's reply was produced it is answered again from
memory; if the original is still generating, the retry waits for it and gets its
reply (replayed after the fact, not live); only if the original failed or was
abandoned is the retry generated. Each chat call also stores what token truth needs
to resume after a restart (`resume.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from undertow.gateway.engines.protocol import EngineRejected, random_seed
from undertow.gateway.errors import (
    BadRequest,
    Busy,
    ContextTooLong,
    PoolBusy,
    PoolUnavailable,
    Unavailable,
)
from undertow.gateway.render import Detokenizer, Renderer
from undertow.gateway.resume import head_record, message_of_events
from undertow.gateway.sessions import Session, SessionRegistry
from undertow.gateway.store import TreeStore
from undertow.gateway.tokentruth import (
    TOKEN_TRUTH_POLICIES,
    VERBATIM,
    Head,
    Prompt,
    build_prompt,
)
from undertow.gateway.toolparsers import Content, Event, Unparsed, create_parser


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters in SGLang's names; `max_new_tokens=None` fills the context."""

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    constraint: tuple[str, str] | None = None  # (SGLang's json_schema|regex|ebnf, its text)

    def to_engine(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p,
                                  "top_k": self.top_k}
        if self.stop:
            params["stop"] = list(self.stop)
        # Always a seed, recorded with the call so that it can be replayed: SGLang 0.5.23
        # gives a request without one the seed 42 (engines/client.py, item 1).
        params["sampling_seed"] = random_seed() if self.seed is None else self.seed + index
        if self.constraint is not None:
            params[self.constraint[0]] = self.constraint[1]
        return params


@dataclass(frozen=True)
class CallRequest:
    """A call in internal form: chat `messages` (OpenAI-style dicts, with
    `reasoning_content`) and `tools`, or raw `prompt_ids` (text completions)."""

    api: str
    model: str
    sampling: Sampling
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    parse_tools: bool = True
    prompt_ids: list[int] | None = None
    n: int = 1
    fingerprint: str = ""
    is_retry: bool = False
    template_kwargs: dict | None = None  # chat_template_kwargs, reasoning_effort
    tool_parser: str | None = None  # instead of the gateway's (forced tool calls)


@dataclass(frozen=True)
class Delta:
    """New output of choice `index`: its parsed events and the tokens behind them."""

    index: int
    call_id: str
    events: list[Event]
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Sampled:
    """One choice as sampled, not yet recorded: what `CallRunner._sample` yields after
    its `Delta`s, for `_record` to put in the tree. `events` are all the parsed events,
    `text` the output less any stop string, `sampling` the engine's sampling parameters."""

    index: int
    call_id: str
    token_ids: list[int]
    events: list[Event]
    logprobs: list[float]
    weight_versions: list[int]
    text: str
    finish_reason: dict
    cached_tokens: int
    first_token_s: float | None
    sampling: dict[str, Any]


@dataclass(frozen=True)
class Choice:
    index: int
    call_id: str
    message: dict
    text: str
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: dict

    @property
    def tool_calls(self) -> list[dict]:
        return self.message.get("tool_calls") or []


@dataclass(frozen=True)
class Outcome:
    """A recorded call, as the APIs format it. It holds no prompt (a session remembers
    its last replies for SDK retries, and a long history's IDs would stay alive)."""

    choices: list[Choice]
    num_prompt_tokens: int
    num_cached_tokens: int
    created_s: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)


class CallRunner:
    """Runs calls for every API against one pool, store, renderer and session registry."""

    def __init__(self, *, pool, store: TreeStore, renderer: Renderer, sessions: SessionRegistry,
                 metrics, context_length: int, default_max_tokens: int, tool_parser: str,
                 token_truth: str = VERBATIM):
        if token_truth not in TOKEN_TRUTH_POLICIES:
            raise ValueError(f"token_truth={token_truth!r}: choose one of "
                             f"{TOKEN_TRUTH_POLICIES}")
        self.token_truth = token_truth
        self.pool, self.store, self.renderer, self.sessions = pool, store, renderer, sessions
        self.metrics = metrics
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.tool_parser = tool_parser
        create_parser(tool_parser)

    def prompt(self, session: Session, request: CallRequest) -> Prompt:
        if request.prompt_ids is not None:
            return Prompt(list(request.prompt_ids), None, None, 0, (), "")
        tree = self.store.tree(session.group)

        def path_token_ids(leaf: int) -> list[int]:
            """A list the prompt may own: the newest head's own (it gives it up, see
            `_leave_head`), else a new one from the tree."""
            newest = session.heads[-1] if session.heads else None
            if newest is not None and newest.leaf == leaf and newest.token_ids is not None:
                session.heads[-1] = replace(newest, token_ids=None)
                return newest.token_ids
            return tree.path_token_ids(leaf)

        prompt = build_prompt(self.renderer.with_kwargs(request.template_kwargs),
                              request.messages, request.tools, session.heads,
                              path_token_ids, policy=self.token_truth)
        self.metrics.token_truth.inc(outcome="hit" if prompt.token_truth else "full_render")
        if prompt.branch:
            self.metrics.branches.inc(reason=prompt.branch)
        return prompt

    def max_new_tokens(self, prompt: Prompt, sampling: Sampling) -> int:
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
        """The recorded `Outcome` of a call whose reply is not streamed."""
        outcome = None
        async for item in self.stream(session, request):
            outcome = item if isinstance(item, Outcome) else outcome
        return outcome

    async def stream(self, session: Session, request: CallRequest
                     ) -> AsyncIterator[Delta | Outcome]:
        """Deltas as sampled, then the recorded `Outcome` (see the module docstring)."""
        replay = await self._earlier_reply(session, request)
        if replay is not None:
            for item in replay:
                yield item
            return
        in_flight = asyncio.get_running_loop().create_future()
        if request.fingerprint:
            session.in_flight.setdefault(request.fingerprint, in_flight)
        try:
            async for item in self._generate(session, request):
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

    async def _generate(self, session: Session, request: CallRequest
                        ) -> AsyncIterator[Delta | Outcome]:
        self._check_prompt_ids(request)
        prompt = self.prompt(session, request)
        max_new_tokens = self.max_new_tokens(prompt, request.sampling)
        started_s = time.time()
        replay: list[Delta | Outcome] = []
        results: list[Sampled] = []
        # One choice (nearly every call) is sampled in the caller's task, n in tasks.
        items = (self._sample(session, request, prompt, 0, f"call-{secrets.token_hex(8)}",
                              max_new_tokens) if request.n == 1
                 else self._choices(session, request, prompt, max_new_tokens))
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
        outcome = await self._record(session, request, prompt, results, started_s)
        replay.append(outcome)
        if request.fingerprint:
            session.remember_reply(request.fingerprint, replay)
        yield outcome

    def _check_prompt_ids(self, request: CallRequest) -> None:
        if request.prompt_ids is None:
            return
        vocab_size = self.renderer.tokenizer.get_vocab_size(with_added_tokens=True)
        if not request.prompt_ids or not all(
                isinstance(t, int) and 0 <= t < vocab_size for t in request.prompt_ids):
            raise BadRequest(f"prompt token IDs must be a non-empty list of integers in "
                             f"[0, {vocab_size})", param="prompt")

    async def _choices(self, session: Session, request: CallRequest, prompt: Prompt,
                       max_new_tokens: int) -> AsyncIterator[Delta | Sampled]:
        """The deltas of `request.n` choices sampled side by side, as they come, and each
        choice's result after its deltas."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(session, request, prompt, index,
                                                      max_new_tokens, queue))
                 for index in range(request.n)]
        num_results = 0
        try:
            while num_results < request.n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                num_results += isinstance(item, Sampled)
                yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _run_choice(self, session: Session, request: CallRequest, prompt: Prompt,
                          index: int, max_new_tokens: int, queue: asyncio.Queue) -> None:
        """Samples one choice; its deltas, then its result (or its error, which `_generate`
        translates) go to `queue`."""
        try:
            async for item in self._sample(session, request, prompt, index,
                                           f"call-{secrets.token_hex(8)}", max_new_tokens):
                queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            queue.put_nowait(error)

    async def _sample(self, session: Session, request: CallRequest, prompt: Prompt, index: int,
                      call_id: str, max_new_tokens: int) -> AsyncIterator[Delta | Sampled]:
        """One choice's `Delta`s as sampled, then its `Sampled` (for `_record`)."""
        parser = self._parser(request, prompt) if request.messages is not None else None
        detokenizer = Detokenizer(self.renderer, not (parser and parser.keeps_special_tokens))
        stops = StopTrimmer(request.sampling.stop)
        token_ids, logprobs, versions, all_events = [], [], [], []
        finish_reason, cached, first_token_s = None, 0, None
        params = request.sampling.to_engine(max_new_tokens, index)
        chunks = self.pool.generate(session.session_id, prompt.token_ids, params, call_id,
                                    input_ids_json=prompt.token_ids_json)
        async with contextlib.aclosing(chunks):  # closing this closes the generation
            async for chunk in chunks:
                first_token_s = first_token_s or time.time()
                token_ids += chunk.token_ids
                logprobs += chunk.logprobs
                versions += chunk.weight_versions
                finish_reason = chunk.finish_reason or finish_reason
                cached = max(cached, chunk.cached_tokens)
                text = stops.push(detokenizer.push(chunk.token_ids))
                events = (parser.feed(text) if parser else [Content(text)]) if text else []
                all_events += events
                yield Delta(index, call_id, events, list(chunk.token_ids), list(chunk.logprobs))
        text = stops.push(detokenizer.flush(), final=True)
        events = (parser.feed(text) if parser and text else [Content(text)] if text else [])
        events += parser.finish() if parser else []
        all_events += events
        self.metrics.unparsed_tool_calls.inc(sum(isinstance(e, Unparsed) for e in all_events),
                                             parser=request.tool_parser or self.tool_parser)
        yield Delta(index, call_id, events, [], [])
        yield Sampled(index, call_id, token_ids, all_events, logprobs, versions, stops.text,
                      finish_reason or {"type": "stop", "matched": None}, cached,
                      first_token_s, params)

    async def _record(self, session: Session, request: CallRequest, prompt: Prompt,
                      results: list[Sampled], started_s: float) -> Outcome:
        """Applies the choices' records to the tree and writes their lines, all or none
        (a failed write undoes the tree's change and raises `StoreUnavailable`, a 503);
        only then leaves the session's heads, choice 0's last, so that it is the newest:
        a scaffold that continues choice 0 (as they do) extends the newest head, with no
        branch. (`HeadReplay` keeps that order after a restart.)"""
        tree = self.store.tree(session.group)
        num_prompt = len(prompt.token_ids)
        head = (head_record(prompt, session.heads, self._parses_tools(request))
                if request.messages is not None else None)
        results = sorted(results, key=lambda item: item.index)
        with tree.transaction():
            records = [self._add_call(tree, session, request, prompt, result, head, started_s)
                       for result in results]
            written = self.store.submit(session.group, *(r.to_json() for r in records))
        leaves = [call.leaf for call in tree.calls[-len(results):]]
        choices = [self._choice(result, request) for result in results]
        if request.messages is not None:
            for choice, leaf in reversed(list(zip(choices, leaves, strict=True))):
                self._leave_head(session, request, prompt, choice, leaf, num_prompt)
        session.num_calls += 1
        await written  # a done future (`flush` mode) is awaited without a loop turn
        self.metrics.prompt_tokens.inc(num_prompt, api=request.api)
        self.metrics.completion_tokens.inc(sum(len(c.token_ids) for c in choices),
                                           api=request.api)
        first = [r.first_token_s for r in results if r.first_token_s]
        if first:
            self.metrics.time_to_first_token_s.observe(min(first) - started_s, api=request.api)
        return Outcome(choices, num_prompt, max(result.cached_tokens for result in results))

    @staticmethod
    def _add_call(tree, session: Session, request: CallRequest, prompt: Prompt, result: Sampled,
                  head: dict | None, started_s: float):
        branch = prompt.branch if result.index == 0 else "sample"
        meta = {"api": request.api, "model": request.model,
                "finish_reason": result.finish_reason, "sampling": result.sampling,
                "cached_tokens": result.cached_tokens, "extends": prompt.extends,
                "token_truth": prompt.token_truth,
                **({"head": head} if head else {}),
                "timings": {"start_s": started_s, "first_token_s": result.first_token_s,
                            "end_s": time.time()}}
        return tree.add_call(result.call_id, session.session_id, prompt.token_ids,
                             result.token_ids, result.logprobs, result.weight_versions,
                             branch=branch, meta=meta, extends_leaf=prompt.extends_leaf)

    def _leave_head(self, session: Session, request: CallRequest, prompt: Prompt,
                    choice: Choice, leaf: int, num_prompt: int) -> None:
        """The head this choice leaves for the session's next call. With one choice, the
        head owns a new list of its path's IDs (the prompt's and the completion's), which
        the next call takes over instead of copying 128k IDs out of the tree. The prompt's
        own list is never extended: the pool, the engine request and a migration still
        running may hold it as an unchanging list."""
        token_ids = prompt.token_ids + choice.token_ids if request.n == 1 else None
        ids_json = (prompt.token_ids_json.extend(choice.token_ids)
                    if prompt.token_ids_json is not None else None)
        session.add_head(Head(choice.call_id, prompt.message_keys, prompt.tools_key,
                              choice.message, leaf, num_prompt,
                              self.renderer.closing_text(choice.token_ids), prompt.messages,
                              ids_json, token_ids,
                              self.renderer.next_turn_start(choice.token_ids)),
                         self.sessions.num_heads)

    def _choice(self, result: Sampled, request: CallRequest) -> Choice:
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if request.messages is not None:  # the events parsed while streaming
            message = message_of_events(result.events, lambda: f"call_{secrets.token_hex(12)}")
        return Choice(result.index, result.call_id, message, result.text,
                      result.token_ids, result.logprobs, result.weight_versions,
                      result.finish_reason)

    def _parser(self, request: CallRequest, prompt: Prompt):
        """A tool-call parser for one choice, told the tools and the prompt's last text."""
        tail = self.renderer.decode(prompt.token_ids[-8:], skip_special_tokens=False)
        return create_parser(request.tool_parser or self.tool_parser,
                             parse_tools=self._parses_tools(request), tools=request.tools,
                             prompt_tail=tail)

    @staticmethod
    def _parses_tools(request: CallRequest) -> bool:
        return request.parse_tools and bool(request.tools)


class StopTrimmer:
    """The reply text up to (not including) the first stop string, as the APIs return it;
    the tree keeps every sampled token. While streaming, the last characters that could
    begin a stop string are held back until the next text shows they do not."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self._pending = ""
        self._stopped = False

    def push(self, text: str, final: bool = False) -> str:
        if self._stopped or not self.stops:
            self.text += "" if self._stopped else text
            return "" if self._stopped else text
        self._pending += text
        cut = min((i for i in (self._pending.find(stop) for stop in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            out, self._pending, self._stopped = self._pending[:cut], "", True
        else:
            keep = 0 if final else max(len(stop) for stop in self.stops) - 1
            split = max(0, len(self._pending) - keep)
            out, self._pending = self._pending[:split], self._pending[split:]
        self.text += out
        return out


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
