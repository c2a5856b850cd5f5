"""Generations in flight: streaming them, interrupting them, and resuming them elsewhere.

Flow: `InFlight.generate` runs one generation as a chain of attempts. Each attempt is
admitted (`admission.py`), sent to its engine by a pump task that reads the engine's
pieces into a `PieceBuffer`, and streamed to the consumer as `GenerationChunk`s of new
tokens, one per take of the buffer: every piece that came since the last one.
When the attempt ends without a finish (the engine died, or the pool interrupted it for a
pause or a migration), the next attempt continues on a healthy engine from prompt +
partial output. `interrupt` is how the pool stops attempts on purpose (it marks them and
aborts them until they have ended); `migrate` interrupts every attempt on a draining
engine and, where both engines can, copies its KV to where it resumes (`migration.py`).

Invariants:
- Concatenating a generation's chunks gives exactly the sampled completion: no token is
  duplicated or lost across resumes; each token keeps the weight version that produced it,
  and `max_new_tokens` bounds the whole generation.
- An abort is forwarded only for an abort the pool did not cause itself: an attempt with
  `interrupted_by` set is resumed instead.
- Resume k of generation `rid` runs as `resume_rid(rid, k)` with its own seed
  `resume_seed(seed, k)` (docs/engines.md says why).
- An attempt stops counting as in flight when its ENGINE is done, however slowly the
  consumer reads; a consumer that leaves early aborts the request unless the engine had
  already finished it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from undertow.gateway.engine_pool.admission import Admission
from undertow.gateway.engine_pool.background import BackgroundTasks
from undertow.gateway.engine_pool.fleet import Attempt, EngineRecord, Fleet
from undertow.gateway.engine_pool.migration import (
    MigrationConfig,
    StagedResume,
    migrate_attempt,
    resume_stream,
)
from undertow.gateway.engine_pool.router import EngineState
from undertow.gateway.engines.protocol import (
    SEED_BITS,
    EngineError,
    EngineUnavailable,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
)
from undertow.gateway.metrics import GatewayMetrics

UNKNOWN_WEIGHT_VERSION = -1


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one generation since the previous chunk (docs/engines.md, the pool's contract);
    `received_s`: when the engine's first piece of them came (`time.time()`);
    `storage_tokens`: prompt tokens its attempts so far loaded from KV storage the engines
    share (SGLang's HiCache: a migrated generation's history read back, not prefilled)."""

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: dict | None = None
    cached_tokens: int = 0
    received_s: float = 0.0
    storage_tokens: int = 0


@dataclass(frozen=True)
class InFlightConfig:
    """How long an abort may take (`abort_timeout_s`), how often an interruption repeats
    its abort until the attempt has ended, and how a migration moves KV."""

    abort_timeout_s: float = 2.0
    abort_retry_interval_s: float = 0.2
    migration: MigrationConfig = dataclasses.field(default_factory=MigrationConfig)


class InFlight:
    """Every generation the pool runs, attempt by attempt (see the module doc)."""

    def __init__(self, admission: Admission, fleet: Fleet, metrics: GatewayMetrics,
                 background: BackgroundTasks, config: InFlightConfig) -> None:
        self.admission = admission
        self.fleet = fleet
        self.metrics = metrics
        self.background = background
        self.config = config

    async def generate(self, session_id: str, request: GenerateRequest, *, live: bool = True
                       ) -> AsyncGenerator[GenerationChunk, None]:
        """Streams the generation's new tokens; see docs/engines.md for the contract.
        `request` (with `input_ids`) is the first attempt's, sent as it is; a resume sends
        one derived from it (`resumed_request`). Each chunk holds what the engine sent
        since the previous one was taken (`PieceBuffer`); with `live=False` a chunk comes
        only once an attempt is over, for a consumer that reads the whole reply before it
        answers."""
        if request.input_ids is None:
            raise ValueError("the pool generates from input_ids: tokenize the prompt first")
        produced: list[int] = []
        max_new = request.sampling_params.max_new_tokens
        cause: str | None = None
        cached_tokens = storage_before = 0
        staged: StagedResume | None = None  # a KV migration's staging, for the next attempt
        for num_attempt in itertools.count():
            if cause is not None:
                self.metrics.resumes.inc(cause=cause)
            if max_new is not None and len(produced) >= max_new:
                yield GenerationChunk([], [], [], {"type": "length", "length": max_new},
                                      cached_tokens, time.time())
                return
            attempt_request = (request if num_attempt == 0
                               else resumed_request(request, produced, num_attempt))
            prompt_ids = attempt_request.input_ids
            assert prompt_ids is not None  # as `request`'s
            attempt = await self.admission.admit(session_id, prompt_ids, attempt_request.rid,
                                                 admitted=num_attempt > 0, waits=bool(produced))
            batches = self._stream_attempt(attempt, attempt_request, live, staged)
            resumed_by, storage = cause, 0
            try:
                async with contextlib.aclosing(batches):
                    async for pieces, received_s in batches:
                        if num_attempt == 0:
                            cached_tokens = pieces[-1].cached_tokens or 0
                        if resumed_by is not None:  # a resume's first pieces
                            self._count_resume_prompt(resumed_by, pieces[-1], len(prompt_ids))
                            resumed_by = None
                        storage = pieces[-1].storage_tokens or 0
                        chunk = _joined(pieces, attempt, cached_tokens, received_s,
                                        storage_before + storage)
                        produced += chunk.token_ids
                        if chunk.token_ids or chunk.finish_reason is not None:
                            yield chunk
                        if chunk.finish_reason is not None:
                            return
                cause = attempt.interrupted_by or "engine_died"
                if attempt.interrupted_by is None:
                    await self.admission.mark_dead(attempt.engine,
                                                   "stream ended without finish_reason")
            except EngineUnavailable as error:
                cause = attempt.interrupted_by or "engine_died"
                if attempt.interrupted_by is None:
                    await self.admission.mark_dead(attempt.engine, str(error))
            if attempt.handover is not None:  # a KV migration finishes its copy first
                await attempt.handover.wait()
            staged = attempt.staged
            storage_before += storage

    def _count_resume_prompt(self, cause: str, piece: GenerateChunk, num_prompt: int) -> None:
        """Where a resume's prompt KV came from, as its engine's first piece says: loaded
        from shared storage, found in the engine's own cache (a KV migration's staging
        included), or prefilled anew."""
        cached = min(piece.cached_tokens or 0, num_prompt)
        storage = min(piece.storage_tokens or 0, cached)
        for source, num in (("storage", storage), ("cache", cached - storage),
                            ("prefill", num_prompt - cached)):
            self.metrics.resume_prompt_tokens.inc(num, cause=cause, source=source)

    async def _stream_attempt(self, attempt: Attempt, request: GenerateRequest, live: bool,
                              staged: StagedResume | None = None
                              ) -> AsyncGenerator[tuple[list[GenerateChunk], float], None]:
        """The engine's pieces for one attempt, in lists: all that came since the consumer
        last took them, and when the first of them came (`PieceBuffer.take`). A task reads
        the engine into the buffer, so that the attempt ends (and stops counting as in
        flight) when the ENGINE is done, however slowly the consumer reads; the consumer
        leaving aborts the request. Once the engine has sent its finishing piece the
        attempt has ended; a consumer that leaves then leaves the pump to read the end of
        the stream (`[DONE]`) in the background instead: aborting a finished request would
        cost the engine a request and the gateway its keep-alive connection (a new TCP
        connection for the next generation), and waiting for it would delay the reply."""
        buffer = PieceBuffer(live)
        pump = asyncio.create_task(self._pump(attempt, request, buffer, staged),
                                   name=f"generate-{attempt.rid}")
        finished = False
        try:
            while pieces := await buffer.take():
                finished = pieces[-1].finish_reason is not None
                yield pieces, buffer.received_s
        finally:
            if finished and not pump.done():
                self.admission.end(attempt)
                self.background.adopt(pump)
            elif not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    async def _pump(self, attempt: Attempt, request: GenerateRequest, buffer: PieceBuffer,
                    staged: StagedResume | None = None) -> None:
        engine = attempt.engine
        finished = False  # the engine sent its finishing piece: nothing is left to abort
        try:
            async for piece in resume_stream(engine, request, staged):
                attempt.output_ids += piece.output_ids
                finished = piece.finish_reason is not None
                buffer.put(piece)
            buffer.end()
        except asyncio.CancelledError:
            if engine.state is not EngineState.DEAD and not finished:
                self.background.spawn(self.abort_quietly(engine, attempt.rid))
            raise
        except Exception as error:  # handed to the consumer, which decides
            buffer.end(error)
        finally:
            self.admission.end(attempt)

    async def migrate(self, engine: EngineRecord) -> None:
        """Interrupts every attempt on the engine and resumes each where its session is
        routed now, with its KV copied there first when both engines can."""
        await asyncio.gather(*(
            migrate_attempt(attempt,
                            self.admission.route_now(attempt.session_id, attempt.token_ids),
                            self.config.migration,
                            lambda attempts: self.interrupt(attempts, "migrate"))
            for attempt in list(engine.attempts)))

    async def interrupt(self, attempts: list[Attempt], cause: str) -> None:
        """Marks the attempts for resumption and aborts them on their engines, repeating
        the abort until each has ended (a request still in transit when the first
        abort arrives is not yet known to the engine)."""
        for attempt in attempts:
            attempt.interrupted_by = cause
        pending = [a for a in attempts if a in a.engine.attempts]
        while pending:
            await asyncio.gather(*(self.abort_quietly(a.engine, a.rid) for a in pending))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.abort_retry_interval_s):
                    await self.fleet.wait_until(lambda left=pending: all(
                        a not in a.engine.attempts for a in left))
            pending = [a for a in pending if a in a.engine.attempts
                       and a.engine.state is not EngineState.DEAD]

    async def abort_quietly(self, engine: EngineRecord, rid: str) -> None:
        with contextlib.suppress(EngineError, TimeoutError):
            async with asyncio.timeout(self.config.abort_timeout_s):
                await engine.driver.abort(rid)


class PieceBuffer:
    """The pieces an attempt's pump has read from its engine and its consumer has not
    taken yet. `take` hands over all of them at once: a consumer that falls behind
    (a slow client, a loaded machine) gets what came meanwhile in one list, and handles it
    as one chunk instead of one per token. Not `live`, the consumer is woken only by the
    finishing piece or the stream's end.

    Invariant: the pieces are taken in the order put, each once; after `end`, `take`
    returns what is left, then raises the pump's error if there was one, else returns []."""

    def __init__(self, live: bool = True) -> None:
        self.live = live
        self.received_s = 0.0  # when the first of the pieces not yet taken came
        self._pieces: list[GenerateChunk] = []
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, piece: GenerateChunk) -> None:
        if not self._pieces:
            self.received_s = time.time()
        self._pieces.append(piece)
        if self.live or piece.finish_reason is not None:
            self._wake()

    def end(self, error: BaseException | None = None) -> None:
        self._ended, self._error = True, error
        self._wake()

    async def take(self) -> list[GenerateChunk]:
        while not self._pieces and not self._ended:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces, self._pieces = self._pieces, []
        if not pieces and self._error is not None:
            raise self._error
        return pieces

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _joined(pieces: list[GenerateChunk], attempt: Attempt, cached_tokens: int,
            received_s: float, storage_tokens: int) -> GenerationChunk:
    """One chunk of an attempt's pieces (in order; only the last may finish it): their
    tokens, logprobs and each token's weight version. An abort the pool caused itself
    (`interrupted_by`) is no finish: the generation resumes."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for piece in pieces:
        token_ids += piece.output_ids
        logprobs += _logprobs(piece)
        versions += [parse_weight_version(piece.weight_version)] * len(piece.output_ids)
    final = _finish_dict(pieces[-1].finish_reason)
    if attempt.interrupted_by and final and final["type"] == "abort":
        final = None
    return GenerationChunk(token_ids, logprobs, versions, final, cached_tokens, received_s,
                           storage_tokens)


def parse_weight_version(value: Any) -> int:
    """An engine's `weight_version` string as an int; -1 ("unknown") when it is not one."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return UNKNOWN_WEIGHT_VERSION


def resume_rid(rid: str, num_attempt: int) -> str:
    """The request ID of resume `num_attempt` (>= 1) of generation `rid`: it starts with
    neither `rid` nor another resume's ID (SGLang aborts every rid that starts with the one
    named: docs/engines.md), and still names `rid`."""
    return f"resume{num_attempt}~{rid}"


def resume_seed(seed: int, num_attempt: int) -> int:
    """The `sampling_seed` of resume `num_attempt` of a generation seeded `seed`: another
    seed, the same on every replay of the run."""
    digest = hashlib.blake2b(f"{seed}/{num_attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def resumed_request(request: GenerateRequest, produced: list[int],
                    num_attempt: int) -> GenerateRequest:
    """The engine request of resume `num_attempt` (>= 1) of the generation whose first
    attempt sent `request`, after it `produced` these tokens: its input is the prompt and
    them (serialised anew where they are some: the caller's JSON array is of the prompt
    alone), its ID and seed its own (`resume_rid`, `resume_seed`; without a seed the driver
    draws a fresh one), and its `max_new_tokens` reduced by what was produced."""
    assert request.input_ids is not None  # `InFlight.generate` checks it
    params = request.sampling_params
    max_new, seed = params.max_new_tokens, params.sampling_seed
    return GenerateRequest(
        input_ids=[*request.input_ids, *produced] if produced else request.input_ids,
        sampling_params=params.evolve(
            max_new_tokens=None if max_new is None else max(max_new - len(produced), 0),
            sampling_seed=None if seed is None else resume_seed(seed, num_attempt)),
        rid=resume_rid(request.rid, num_attempt), return_logprob=request.return_logprob,
        input_ids_json=None if produced else request.input_ids_json)


def _logprobs(piece: GenerateChunk) -> list[float]:
    """One logprob per output token (NaN where the engine reported none)."""
    pairs = piece.output_token_logprobs
    if len(pairs) != len(piece.output_ids):
        return [math.nan] * len(piece.output_ids)
    return [logprob for logprob, _ in pairs]


def _finish_dict(reason: FinishReason | None) -> dict | None:
    """SGLang's `finish_reason` object, as the API consumes it."""
    if reason is None:
        return None
    data: dict[str, Any] = {"type": reason.type, "matched": reason.matched}
    if reason.message is not None:
        data["message"] = reason.message
    return data
