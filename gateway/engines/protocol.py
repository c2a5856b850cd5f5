"""The engine protocols: what the gateway needs from any inference engine.

Two `typing.Protocol`s, whose methods mirror SGLang's native HTTP API (see docs/design.md,
"The seams"):
- `EngineDriver`, generation and its control: what the engine pool (`pool.py`, `fleet.py`,
  `inflight.py`, `weight_updates.py`) calls on every engine. Two drivers implement it:
  `sglang.SGLangDriver` (a real SGLang server, or Undertow's built-in engine, which speaks
  the same API) and `vllm.VLLMDriver` (a real vLLM server, adapted).
- `KVTransfer`, an optional extension: moving a running request's KV to another engine,
  what migration (`migration.py`) calls where `kv_transfer_of` finds it (`SGLangDriver`
  on the built-in engine).
The records here are plain, typed and engine-neutral; each driver alone converts them to and
from its wire format (`SamplingParams` included).

Errors: `EngineError` and below, one hierarchy for all drivers and launchers, drawn in the
gateway's `errors.py`.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import orjson

from undertow.gateway.errors import GatewayError

__all__ = [
    "CAPABILITIES",
    "EngineDriver",
    "EngineError",
    "EngineLaunchError",
    "EngineRejected",
    "EngineUnavailable",
    "FinishReason",
    "GenerateChunk",
    "GenerateRequest",
    "GenerateResult",
    "IncompatibleCheckpoint",
    "KVPayload",
    "KVTransfer",
    "ModelInfo",
    "PauseMode",
    "SamplingParams",
    "StagedKV",
    "TokenIdsJson",
    "WeightsNotUpdated",
    "kv_transfer_of",
    "random_seed",
    "result_from_chunks",
]

PauseMode = Literal["abort", "in_place", "retract"]

# Optional features an engine may lack; `EngineDriver.capabilities` names those it has.
CAPABILITIES = frozenset({
    "text_input",          # GenerateRequest.text instead of input_ids
    "cached_tokens",       # results report how many prompt tokens came from the prefix cache
    "pause_abort",         # pause(mode="abort")
    "pause_in_place",      # pause(mode="in_place"): running requests keep their KV and wait
    "update_weights_from_disk",
    "flush_cache",
    "abort_all",           # abort(None) aborts every request
})


class EngineError(GatewayError):
    """Base of every error an engine driver or launcher raises. Where one reaches a
    client untranslated, the gateway answers 502 (the engine, not the gateway, failed)."""

    status = 502


class EngineUnavailable(EngineError):
    """The engine did not answer: refused connection, dropped stream, a 5xx reply, or a
    reply that breaks the protocol (a logprob that is null).

    The request may have been partly served; resume it elsewhere from its partial output.
    """


class EngineRejected(EngineError):
    """The engine refused the request (a 4xx reply); `message` is the engine's own reason."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        where = f" ({status} from {url})" if status is not None else ""
        super().__init__(f"engine rejected the request{where}: {message}")
        self.message = message
        if status is not None:   # else the class's 502
            self.status = status
        self.url = url


class EngineLaunchError(EngineError):
    """A launcher could not start an engine; the message says why and ends with its log tail."""


class WeightsNotUpdated(EngineRejected):
    """A weight update did not complete. `loaded` is True when the engine did load the new
    weights all the same (so it no longer serves the old ones) and `weight_version` is the
    version the engine reports now (None when it could not be read)."""

    def __init__(self, message: str, *, loaded: bool, weight_version: str | None,
                 url: str | None = None):
        super().__init__(message, url=url)
        self.loaded = loaded
        self.weight_version = weight_version


SEED_BITS = 31  # a seed every engine takes (SGLang: int64; vLLM and torch: up to 2**64 - 1)


class IncompatibleCheckpoint(EngineRejected):
    """A weight update refused before any engine got it: the checkpoint does not fit the
    model the engines serve (`checkpoints.check_checkpoint`, which names the mismatch)."""

    status = 400

    def __init__(self, message: str):
        EngineError.__init__(self, message)  # the gateway's refusal, no engine's
        self.message, self.url = message, None


def random_seed() -> int:
    """A fresh `sampling_seed`, for a request whose caller gave none."""
    return secrets.randbits(SEED_BITS)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a completion, with SGLang's names and defaults: the one value a call's
    sampling takes from the API (built once, `api/output_options.OutputConstraint`) through
    the call runner, each choice's engine request (`sampler.choice_request`) and the pool's
    attempts to the engine driver, which alone writes it in its engine's form
    (`sglang.sglang_sampling_params`; vLLM's names in `vllm.py`).

    `temperature == 0` is greedy. `top_k == -1` and `top_p == 1` disable those filters.
    `max_new_tokens=None` fills the context (as in SGLang; the gateway's call runner sets
    the bound itself, `CallRunner.max_new_tokens`). At most one of the structured-output
    fields is set (SGLang's own: a JSON schema as JSON text, a regular expression, an
    EBNF grammar, or a structural tag as JSON text, xgrammar's format, that the output
    must match).

    `sampling_seed` makes sampling reproducible: the same seed and inputs give the same
    output. None means "any": the SGLang driver then draws a fresh random seed for the
    request, because an SGLang server run with `--enable-deterministic-inference` (as the
    `sglang` launcher runs it) gives every request without a seed the seed 42 (SGLang
    0.5.23, `srt/sampling/sampling_batch_info.py`): the sessions of a group that send one
    prompt would all get one completion. A caller that must replay a run picks and records
    the seed itself (the gateway does: `for_choice`, recorded with the call).
    """

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def constrained(self) -> bool:
        """Whether the output is held to a JSON schema, regular expression, grammar or
        structural tag."""
        return not (self.json_schema is None and self.regex is None and self.ebnf is None
                    and self.structural_tag is None)

    def for_choice(self, index: int, max_new_tokens: int, **changes: object) -> SamplingParams:
        """These parameters for choice `index` of a call, bounded to `max_new_tokens`, with
        its seed picked so that it can be recorded and replayed (the call's seed plus
        `index`, or a fresh one when the call gave none), and `changes` (as `evolve`)."""
        seed = random_seed() if self.sampling_seed is None else self.sampling_seed + index
        return self.evolve(max_new_tokens=max_new_tokens, sampling_seed=seed, **changes)

    def evolve(self, **changes: object) -> SamplingParams:
        """A copy with `changes` (field names), as `dataclasses.replace` gives, at a sixth of
        its cost (it runs `__init__` and its frozen checks again: 10 us against 1.5 on the
        2-core machine, once per call and once per resume). There is no `__post_init__`."""
        unknown = changes.keys() - self.__dataclass_fields__.keys()
        if unknown:
            raise TypeError(f"SamplingParams has no fields {sorted(unknown)}")
        evolved = object.__new__(SamplingParams)
        evolved.__dict__.update(self.__dict__, **changes)
        return evolved


@dataclass(frozen=True)
class TokenIdsJson:
    """The JSON array of a list of token IDs, kept in pieces that are never joined, so that
    a session's growing prompt is not copied call by call (a copy of a 128k-token array
    cost 0.5 ms): `extend` adds one piece, and a vectored write sends `pieces` and the
    closing bracket as they are. Invariant: `pieces` joined are the array's JSON without
    its closing "]"; the first piece begins with "[". Past `MAX_PIECES` pieces they are
    joined into one, so a long session pays one copy every `MAX_PIECES` calls."""

    pieces: tuple[bytes, ...]

    MAX_PIECES = 64

    @classmethod
    def of(cls, token_ids: Iterable[int]) -> TokenIdsJson:
        return cls((orjson.dumps(list(token_ids))[:-1],))

    def extend(self, token_ids: Sequence[int]) -> TokenIdsJson:
        """These IDs and then `token_ids`."""
        if not token_ids:
            return self
        items = orjson.dumps(list(token_ids))[1:-1]
        pieces = self.pieces + ((items,) if self.pieces == (b"[",) else (b"," + items,))
        return TokenIdsJson(pieces if len(pieces) <= self.MAX_PIECES
                            else (b"".join(pieces),))

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces) + b"]"


def _new_rid() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: a prompt (`input_ids`, or `text` where the engine tokenizes) and how to
    sample its continuation.

    Invariants: exactly one of `input_ids` and `text` is set; `rid` is unique among the
    requests in flight on one engine (it is what `EngineDriver.abort` names), and no other rid
    sent to that engine starts with it: SGLang 0.5.23 aborts every request whose rid starts
    with the one named (`srt/managers/scheduler.py`, `abort_request`). The default, a UUID's
    32 hex digits, and the gateway's `call-` plus 16 hex digits are fixed-width, so
    prefix-free. `input_ids` is a tuple, or another sequence that nobody changes, kept as
    it is (the gateway's prompts are `TokenPath`s that share a session's history: not
    copying 1M IDs per call).
    `input_ids_json`, where set, is the JSON array of exactly `input_ids`, and the wire body
    carries it as it is (the gateway builds it incrementally, call by call, so a long
    history is not serialised again, nor copied: see `sglang.sglang_body_pieces`).
    """

    input_ids: Sequence[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=_new_rid)
    return_logprob: bool = False
    input_ids_json: TokenIdsJson | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("a GenerateRequest needs exactly one of input_ids and text")
        if self.input_ids is not None and not isinstance(self.input_ids, Sequence):
            object.__setattr__(self, "input_ids", tuple(self.input_ids))


@dataclass(frozen=True)
class FinishReason:
    """Why a generation ended, as SGLang's `meta_info.finish_reason`.

    `type` is "stop" (an EOS or stop token, `matched` its ID; or a stop string, `matched` the
    string), "length" (`max_new_tokens` or the context limit) or "abort" (`message` says why).
    """

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None

    @classmethod
    def from_sglang(cls, reason: dict | None) -> FinishReason | None:
        if reason is None:
            return None
        return cls(type=reason["type"], matched=reason.get("matched"),
                   message=reason.get("message"))


@dataclass(frozen=True)
class GenerateResult:
    """A finished generation.

    Invariants: `output_token_logprobs` is empty unless the request asked for logprobs, and
    then holds one `(logprob, token_id)` per output token with `token_id == output_ids[i]`.
    `text` is the detokenized output (stop strings trimmed, as the engine returns it).
    `cached_tokens` is None where the engine does not report it; `weight_version` names the
    weights that produced the output (the last ones, if they changed during generation).
    `storage_tokens`: how many of the cached tokens the engine loaded from KV storage it
    shares with other engines (SGLang's HiCache; None where it reports none).
    """

    rid: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    output_token_logprobs: list[tuple[float, int]]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    weight_version: str | None
    storage_tokens: int | None = None


class GenerateChunk(NamedTuple):
    """One piece of a streamed generation: what is new since the previous chunk.

    Invariants: `output_ids`, `text` and `output_token_logprobs` are deltas; the last chunk of
    a stream, and only it, has a `finish_reason`. Counts are totals so far. `weight_version`
    may be None before the last chunk on engines that report it only at the end (vLLM).
    A named tuple, not a frozen dataclass, for what it costs: a stream makes one per
    engine event (a frozen dataclass of these nine fields took 1.7 us to build, this 0.4).
    """

    rid: str
    output_ids: list[int]
    text: str
    output_token_logprobs: list[tuple[float, int]]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    weight_version: str | None
    storage_tokens: int | None = None  # as `GenerateResult.storage_tokens`


def result_from_chunks(chunks: Iterable[GenerateChunk]) -> GenerateResult:
    """Join a whole stream into the result a non-streaming call would have returned."""
    output_ids: list[int] = []
    texts: list[str] = []
    logprobs: list[tuple[float, int]] = []
    last = None
    for chunk in chunks:
        output_ids.extend(chunk.output_ids)
        texts.append(chunk.text)
        logprobs.extend(chunk.output_token_logprobs)
        last = chunk
    if last is None or last.finish_reason is None:
        raise EngineUnavailable("the stream ended before the generation finished")
    return GenerateResult(
        rid=last.rid, output_ids=output_ids, text="".join(texts),
        finish_reason=last.finish_reason, output_token_logprobs=logprobs,
        prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens, weight_version=last.weight_version,
        storage_tokens=last.storage_tokens)


@dataclass(frozen=True)
class ModelInfo:
    """What an engine serves: the model directory it loaded and its current weight version.

    `raw` is the engine's own reply, for fields this record does not name.
    """

    model_path: str
    weight_version: str | None
    raw: dict


@runtime_checkable
class EngineDriver(Protocol):
    """One inference engine, reached over HTTP at `url`.

    `generate` and `generate_stream` raise `EngineRejected` for a request the engine refuses
    (the engine keeps serving the others) and `EngineUnavailable` when the engine cannot be
    reached or dies mid-generation. An aborted generation is not an error: it returns its
    partial output with `finish_reason.type == "abort"`. Methods named in `CAPABILITIES` raise
    `EngineRejected` on engines whose `capabilities` lack them.
    """

    url: str
    capabilities: frozenset[str]

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]: ...

    async def abort(self, rid: str | None) -> None:
        """Abort the request `rid` (None: every request). Unknown rids are ignored."""
        ...

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating until `resume`. "abort" ends running requests (their partial
        output is returned); "in_place" keeps them, to continue where they were; "retract"
        (SGLang only) frees their KV and recomputes it on `resume`."""
        ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str,
                                       weight_version: str | None = None) -> None:
        """Load new weights from a model directory; in-flight requests finish first, except
        those an `in_place` pause holds (SGLang retracts them, and they continue with the new
        weights after `resume`; vLLM lets them finish first). A paused engine stays paused.

        Afterwards the prefix cache holds nothing computed with the old weights and the
        engine reports `weight_version`. When that cannot be had, it raises
        `WeightsNotUpdated` (`.loaded` says whether the weights changed all the same)."""
        ...

    async def flush_cache(self) -> None: ...

    async def health(self) -> bool:
        """True when the engine is up and takes requests: a cheap probe that generates
        nothing and answers at once during pauses and weight updates; never raises."""
        ...

    async def server_info(self) -> dict: ...

    async def model_info(self) -> ModelInfo: ...

    async def supports_kv_transfer(self) -> bool:
        """Whether the engine has Undertow's KV-transfer extension (`KVTransfer`: export a
        running request's KV, stage it on another engine, generate from it there), which
        migration uses to move a generation without prefilling it again. An optional
        capability: False on engines without it (SGLang, vLLM); never raises."""
        ...

    async def honours_seeds(self) -> bool | None:
        """Whether a request's `sampling_seed` decides its sample, so that the seed recorded
        with a call replays it (SGLang 0.5.23 honours it only with
        `--enable-deterministic-inference`); None when the engine does not say or does not
        answer. Never raises."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class KVPayload:
    """The KV of token positions [start, end) of one sequence, as exported by an engine with
    Undertow's `kv_transfer` extension (`builtin_engine/undertow_kv.py`); `data` is opaque
    here and goes as it is to another engine's `import_kv` or `stage_kv`."""

    data: bytes
    start: int
    end: int


@dataclass(frozen=True)
class StagedKV:
    """A staged KV import on an engine (Undertow's `kv_transfer` extension): the KV of the
    first `num_tokens` tokens of a sequence whose IDs have the digest `digest`
    (`kv_wire.PrefixDigest`), held in a slot of its own until a `generate_staged_stream`
    names its `handle`."""

    handle: str
    num_tokens: int
    digest: str


@runtime_checkable
class KVTransfer(Protocol):
    """Undertow's KV-transfer extension of an engine: export a running request's KV, stage it
    on another engine, and continue the request there from it (`migration.py` says how).
    Errors as `EngineDriver`'s; `kv_transfer_of` says whether a driver's engine has it."""

    async def export_kv(self, *, rid: str | None = None, input_ids: list[int] | None = None,
                        start: int = 0, span_ids: bool = False, stop: bool = False
                        ) -> KVPayload:
        """The KV of running request `rid`, or of the longest cached prefix of `input_ids`,
        from position `start` on; `span_ids`: the payload names only its own span's IDs;
        `stop` (with `rid`): the request is aborted in the same step."""
        ...

    async def import_kv(self, payload: KVPayload) -> int:
        """Put a payload into the prefix cache; how many of its sequence's tokens it holds."""
        ...

    async def stage_kv(self, payload: KVPayload, handle: str | None = None) -> StagedKV:
        """Stage a payload for the request that will continue its sequence: a new staging
        (`handle` None, the payload starts at 0) or the next span of `handle`'s."""
        ...

    async def release_kv(self, handle: str) -> None:
        """Free a staging that no request will use."""
        ...

    def generate_staged_stream(self, request: GenerateRequest,
                               staged: StagedKV) -> AsyncGenerator[GenerateChunk, None]:
        """`EngineDriver.generate_stream` of `request`, whose first `staged.num_tokens` input
        IDs are staged: a staging that is gone (404) or holds another prefix (409) raises
        `EngineRejected` before any chunk."""
        ...


async def kv_transfer_of(driver: EngineDriver) -> KVTransfer | None:
    """`driver` as a `KVTransfer`, where it has the methods and its engine the extension
    (`EngineDriver.supports_kv_transfer`); None otherwise. Never raises."""
    if isinstance(driver, KVTransfer) and await driver.supports_kv_transfer():
        return driver
    return None
