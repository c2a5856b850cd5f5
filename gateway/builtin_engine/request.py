"""One generation request: parsed from SGLang's `GenerateReqInput` JSON, and its running state.

`parse_generate` validates a `/generate` body (SGLang 0.5.x field names) and returns one
`Request` per prompt (a batch body gives several). The scheduler's worker thread appends to a
request's `output_*` lists; the event loop only reads prefixes of them (list appends are atomic,
so a prefix it has been told about never changes).
"""

import time
import uuid
from dataclasses import dataclass, field

import torch

from undertow.gateway.builtin_engine.errors import BadRequest
from undertow.gateway.builtin_engine.grammar import GrammarState
from undertow.gateway.builtin_engine.radix_cache import Match
from undertow.gateway.builtin_engine.sampling import (
    RequestSampling,
    make_generator,
    parse_sampling_params,
)

_KNOWN_TYPES = {"rid": (str, list), "stream": bool, "return_logprob": bool,
                "logprob_start_len": int, "top_logprobs_num": int,
                "return_text_in_logprobs": bool, "sampling_params": (dict, list)}


@dataclass(eq=False)
class Request:
    """A request inside the engine.

    Invariants: `output_ids`, `output_logprobs` (and `output_top_logprobs` when asked) grow
    together by one entry per sampled token; `finish_reason` is set once, last; `kv_length` is
    how many positions of input_ids + output_ids have KV in the request's slot;
    `staged_handle` names the staged KV import it claimed (`staging.py`) until admitted.
    """

    rid: str
    input_ids: list[int]
    generator: torch.Generator
    params: RequestSampling
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: dict | None = None
    created_s: float = field(default_factory=time.monotonic)
    kv_length: int = 0
    match: Match | None = None
    epoch: int = -1
    weight_version: str | None = None
    staged_handle: str | None = None
    grammar: GrammarState | None = None  # a constrained request's (`grammar.py`)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def last_id(self) -> int:
        """The token at position `kv_length` while running: the next one a decode step reads."""
        return self.output_ids[-1] if self.output_ids else self.input_ids[-1]

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids


def _check_type(body: dict, name: str) -> None:
    expected = _KNOWN_TYPES[name]
    value = body[name]
    if (isinstance(value, bool) and expected is int) or not isinstance(value, expected):
        raise BadRequest(f"{name} has the wrong type: {value!r}")


def _token_ids(value, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise BadRequest("input_ids must be a non-empty list of token IDs")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise BadRequest(f"input_ids holds {token!r}, which is not a token ID in "
                             f"[0, {vocab_size})")
    return value


def _prompts(body: dict, encode, vocab_size: int) -> tuple[list[list[int]], bool]:
    """The prompts' token IDs and whether the body was a batch."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("give exactly one of input_ids and text")
    if has_text:
        text = body["text"]
        if isinstance(text, str):
            return [_token_ids(encode(text), vocab_size)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [_token_ids(encode(t), vocab_size) for t in text], True
        raise BadRequest("text must be a non-empty string or a list of strings")
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(item, list) for item in ids):
        return [_token_ids(item, vocab_size) for item in ids], True
    return [_token_ids(ids, vocab_size)], False


def parse_generate(body, encode, vocab_size: int, context_length: int
                   ) -> tuple[list[Request], bool]:
    """Validate a /generate body; return its requests and whether it was a batch."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for name in _KNOWN_TYPES:
        if body.get(name) is not None:
            _check_type(body, name)
    prompts, batch = _prompts(body, encode, vocab_size)
    rids = body.get("rid")
    if isinstance(rids, list) != (batch and rids is not None):
        raise BadRequest("rid must be a string, or a list of strings for a batch")
    if rids is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif not batch:
        rids = [rids]
    if len(rids) != len(prompts) or not all(isinstance(r, str) and r for r in rids):
        raise BadRequest("rid must hold one non-empty string per prompt")
    raw_params = body.get("sampling_params")
    raw_params = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
    if len(raw_params) != len(prompts):
        raise BadRequest("sampling_params must be one object, or one per prompt")
    start = body.get("logprob_start_len", -1)
    start = -1 if start is None else start
    top_n = body.get("top_logprobs_num") or 0
    if top_n < 0 or start < -1:
        raise BadRequest("top_logprobs_num must be >= 0 and logprob_start_len >= -1")
    requests = []
    for rid, ids, raw in zip(rids, prompts, raw_params, strict=True):
        params = parse_sampling_params(raw, vocab_size)
        _check_length(len(ids), params.max_new_tokens, context_length)
        if start >= len(ids):
            raise BadRequest(f"logprob_start_len={start} must be below the prompt length "
                             f"{len(ids)}")
        requests.append(Request(
            rid=rid, input_ids=list(ids), params=params,
            return_logprob=bool(body.get("return_logprob")), logprob_start_len=start,
            top_logprobs_num=min(top_n, vocab_size),
            return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
            stream=bool(body.get("stream")), generator=make_generator(params)))
    return requests, batch


def _check_length(num_input: int, max_new_tokens: int, context_length: int) -> None:
    if num_input + max_new_tokens > context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {num_input + max_new_tokens} "
            f"tokens: {num_input} tokens from the input and {max_new_tokens} tokens for the "
            f"completion. Shorten the input or lower max_new_tokens.")
