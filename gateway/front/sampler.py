"""Sampling a call's choices: engine pool chunks -> text -> parsed events, as they come
(docs/design.md, "From a scaffold's HTTP call to the tree", step 8). `CallRunner` iterates
`ChoiceSampler.sample_all`; each choice's `Sampled` goes to `call_record.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator

from undertow.gateway.engine_pool.pool import EnginePool
from undertow.gateway.engines.protocol import GenerateRequest
from undertow.gateway.front.call_types import CallRequest, Delta, Sampled
from undertow.gateway.front.tokentruth import Prompt
from undertow.gateway.front.toolparsers import (
    Content,
    Event,
    ToolParser,
    Unparsed,
    create_parser,
    reasoning_first,
)
from undertow.gateway.metrics import GatewayMetrics
from undertow.gateway.render import Detokenizer, Renderer


def new_call_id() -> str:
    """A call's ID, also its engine request's `rid`: `call-` and 16 hex digits, so that
    no two start with each other (docs/engines.md, the engine pool's request IDs)."""
    return f"call-{secrets.token_hex(8)}"


class ChoiceSampler:
    """Samples choices on one pool, with one renderer and the gateway's tool parser."""

    def __init__(self, *, pool: EnginePool, renderer: Renderer, metrics: GatewayMetrics,
                 tool_parser: str) -> None:
        self.pool, self.renderer, self.metrics = pool, renderer, metrics
        self.tool_parser = tool_parser

    def sample_all(self, session_id: str, request: CallRequest, prompt: Prompt,
                   max_new_tokens: int, call_id: str | None = None, live: bool = True
                   ) -> AsyncGenerator[Delta | Sampled, None]:
        """Every choice's deltas, each choice's `Sampled` after its deltas. One choice
        (nearly every call) is sampled in the caller's task, `request.n` in tasks.
        `call_id` names choice 0 (its engine `rid`); the other choices get new IDs.
        `live=False` (a reply that is not streamed): the deltas come when the engine is
        done, so that each choice's text is decoded and parsed once, not token by token."""
        call_id = call_id or new_call_id()
        if request.n == 1:
            return self.sample(session_id, request, prompt, 0, call_id, max_new_tokens, live)
        return self._choices(session_id, request, prompt, max_new_tokens, call_id, live)

    async def _choices(self, session_id: str, request: CallRequest, prompt: Prompt,
                       max_new_tokens: int, call_id: str, live: bool
                       ) -> AsyncGenerator[Delta | Sampled, None]:
        """The deltas of `request.n` choices sampled side by side, as they come, and each
        choice's result after its deltas."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(
                     session_id, request, prompt, index, call_id if index == 0 else new_call_id(),
                     max_new_tokens, live, queue))
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

    async def _run_choice(self, session_id: str, request: CallRequest, prompt: Prompt,
                          index: int, call_id: str, max_new_tokens: int, live: bool,
                          queue: asyncio.Queue) -> None:
        """Samples one choice; its deltas, then its result (or its error, which the caller
        translates) go to `queue`."""
        try:
            async for item in self.sample(session_id, request, prompt, index, call_id,
                                          max_new_tokens, live):
                queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            queue.put_nowait(error)

    async def sample(self, session_id: str, request: CallRequest, prompt: Prompt, index: int,
                     call_id: str, max_new_tokens: int, live: bool = True
                     ) -> AsyncGenerator[Delta | Sampled, None]:
        """One choice's `Delta`s as sampled (`live=False`: once the engine is done), then
        its `Sampled` (for the record). Each chunk of the pool's generation is detokenized,
        held back where it could start a stop string (`StopTrimmer`) and fed to the
        tool-call parser. The deltas hold every sampled token once, in order; `Sampled`
        holds them all with their logprobs, weight versions and the engine request's
        sampling parameters (`choice_request`), and the text less any stop string. Closing
        the iteration closes the pool's generation (the engine request is aborted)."""
        parser = self._parser(request, prompt) if request.messages is not None else None
        detokenizer = Detokenizer(self.renderer, not (parser and parser.keeps_special_tokens))
        stops = StopTrimmer(request.sampling.stop)
        token_ids, logprobs, versions, all_events = [], [], [], []
        finish_reason, cached, first_token_s, storage = None, 0, None, 0
        engine_request = choice_request(request, prompt, parser, index, call_id, max_new_tokens)
        chunks = self.pool.generate(session_id, engine_request, live=live)
        async with contextlib.aclosing(chunks):  # closing this closes the generation
            async for chunk in chunks:
                first_token_s = first_token_s or chunk.received_s or time.time()
                token_ids += chunk.token_ids
                logprobs += chunk.logprobs
                versions += chunk.weight_versions
                finish_reason = chunk.finish_reason or finish_reason
                cached = max(cached, chunk.cached_tokens)
                storage = max(storage, chunk.storage_tokens)
                text = stops.push(detokenizer.push(chunk.token_ids))
                events: list[Event] = ((parser.feed(text) if parser else [Content(text)])
                                       if text else [])
                all_events += events
                yield Delta(index, call_id, events, list(chunk.token_ids), list(chunk.logprobs))
        text = stops.push(detokenizer.flush(), final=True)
        events = (parser.feed(text) if parser and text else [Content(text)] if text else [])
        events += parser.finish() if parser else []
        all_events += events
        self.metrics.unparsed_tool_calls.inc(sum(isinstance(e, Unparsed) for e in all_events),
                                             parser=self.tool_parser)
        yield Delta(index, call_id, events, [], [])
        yield Sampled(index, call_id, token_ids, all_events, logprobs, versions, stops.text,
                      finish_reason or {"type": "stop", "matched": None}, cached,
                      first_token_s, engine_request.sampling_params,
                      self.pool.fleet.honours_seeds, storage)

    def _parser(self, request: CallRequest, prompt: Prompt):
        """A tool-call parser for one choice, told the tools and the prompt's last text."""
        tail = self.renderer.decode(prompt.token_ids[-8:], skip_special_tokens=False)
        return create_parser(self.tool_parser,
                             parse_tools=request.parses_tools, tools=request.tools,
                             prompt_tail=tail)


def choice_request(request: CallRequest, prompt: Prompt, parser: ToolParser | None, index: int,
                   call_id: str, max_new_tokens: int) -> GenerateRequest:
    """The engine request of choice `index`, whole, the one place it is built: the call's
    sampling parameters with the choice's seed and bound (`SamplingParams.for_choice`) and a
    forced call's structural tag letting the model close a reasoning block the prompt opened
    (`reasoning_first`), on the prompt's IDs (their JSON array as it is), with logprobs. The
    pool sends it as it is; only a resumed attempt derives its own (`inflight.py`)."""
    sampling = request.sampling
    tag = reasoning_first(sampling.structural_tag, parser) if parser else sampling.structural_tag
    return GenerateRequest(input_ids=prompt.token_ids,
                           sampling_params=sampling.for_choice(index, max_new_tokens,
                                                               structural_tag=tag),
                           rid=call_id, return_logprob=True,
                           input_ids_json=prompt.token_ids_json)


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
