"""SGLang's `/generate` replies read into the engine protocol's results and deltas.

Flow: a non-streamed reply becomes a `GenerateResult` (`read_result`); a stream's events go
through one `StreamReader`, which turns each into a `GenerateChunk` holding only what is new
since the previous one, whichever form SGLang sent (cumulative by default, deltas with
`--incremental-streaming-output`). Of the events that arrived together, those a later one
holds entirely are skipped first (`latest_events`). Both read
`meta_info.output_token_logprobs` with `logprob_pairs`.

Invariants (SGLang 0.5.23, items 4 to 6 of `sglang.py`'s module doc):
- Concatenating a stream's chunks gives each output ID, character and logprob once, also
  when a request aborted while queued answers with its whole output (or its last ID only).
- `storage_tokens` is `meta_info.cached_tokens_details.storage` (SGLang 0.5.23,
  `output_streamer.get_cached_tokens_details`: present only when the server has a HiCache
  storage backend), None where absent.
- A reply the gateway could not record (a `null` logprob, an abort's reply lacking IDs the
  stream never delivered) is `EngineUnavailable`, so that the pool resumes the generation
  elsewhere, never a `TypeError`.
"""

from undertow.gateway.engines.protocol import (
    EngineUnavailable,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
)


def logprob_pairs(entries: list) -> list[tuple[float, int]]:
    """Entries of `meta_info.output_token_logprobs` as (logprob, token ID) pairs. SGLang
    0.5.23 writes a NaN or infinite logprob as `null` (`srt/utils/json_response.py`): such
    a reply cannot be recorded, and the request is resumed elsewhere like one whose engine
    failed."""
    try:
        return [(float(entry[0]), int(entry[1])) for entry in entries]
    except (TypeError, ValueError, IndexError) as error:
        raise EngineUnavailable(
            f"the engine sent a logprob entry that is not [logprob, token_id, text] ({error}); "
            "SGLang writes NaN and infinite logprobs as null, so its model produced one: "
            "check the engine's weights and numerics") from error


def num_prompt_ids(request: GenerateRequest) -> int:
    """The prompt's length where the gateway knows it (0 for a text prompt)."""
    return 0 if request.input_ids is None else len(request.input_ids)


def read_result(reply: dict, request: GenerateRequest) -> GenerateResult:
    """A non-streamed reply. A request aborted while queued has no `prompt_tokens` or
    `cached_tokens` (SGLang 0.5.23, `tokenizer_manager._handle_abort_req`): the prompt's
    length stands in for the first, and the second is unknown (None)."""
    meta = reply["meta_info"]
    prompt_tokens = meta.get("prompt_tokens")
    finish_reason = FinishReason.from_sglang(meta.get("finish_reason"))
    if finish_reason is None:
        raise EngineUnavailable(f"the engine's reply to {request.rid} has no finish_reason")
    return GenerateResult(
        rid=meta.get("id", request.rid), output_ids=list(reply.get("output_ids") or ()),
        text=reply.get("text") or "", finish_reason=finish_reason,
        output_token_logprobs=logprob_pairs(meta.get("output_token_logprobs") or []),
        prompt_tokens=num_prompt_ids(request) if prompt_tokens is None else prompt_tokens,
        completion_tokens=meta.get("completion_tokens", 0),
        cached_tokens=meta.get("cached_tokens"), weight_version=meta.get("weight_version"),
        storage_tokens=storage_tokens(meta))


def storage_tokens(meta: dict) -> int | None:
    """The prompt tokens an SGLang server loaded from its HiCache storage backend, as
    `meta_info.cached_tokens_details` says (None: it says nothing of storage)."""
    details = meta.get("cached_tokens_details")
    value = details.get("storage") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


class StreamReader:
    """The deltas of one SGLang stream, from events in either form.

    Invariant: `num_ids`, `num_logprobs` and `num_chars` count what the deltas so far hold.
    Every event says the total `completion_tokens`; an event whose `output_ids` are that
    many is cumulative (SGLang's default), a shorter one is a delta
    (`--incremental-streaming-output`). The reply to a request aborted while queued
    (SGLang 0.5.23, `tokenizer_manager._handle_abort_req`) is neither: it has no
    `prompt_tokens`, its text and logprobs are whole and its `output_ids` whole or the last
    ID only; it is read as cumulative, and the counts it lacks are the stream's earlier ones.
    """

    def __init__(self, rid: str, num_prompt_ids: int):
        self.rid = rid
        self.num_ids = self.num_logprobs = self.num_chars = 0
        self.prompt_tokens = num_prompt_ids
        self.cached_tokens: int | None = None
        self.storage_tokens: int | None = None

    def chunk(self, event: dict) -> GenerateChunk:
        meta = event["meta_info"]
        reason = meta.get("finish_reason")
        finish = None if reason is None else FinishReason.from_sglang(reason)
        output_ids = event.get("output_ids") or []  # the parser's own list: not copied
        text = event.get("text") or ""
        entries = meta.get("output_token_logprobs") or []
        completion_tokens = meta.get("completion_tokens", self.num_ids + len(output_ids))
        if finish is not None and finish.type == "abort" and "prompt_tokens" not in meta:
            logprobs = logprob_pairs(entries)
            output_ids = self._queued_abort_ids(output_ids, logprobs, completion_tokens)
            text, logprobs = text[self.num_chars:], logprobs[self.num_logprobs:]
        elif self.num_ids and len(output_ids) == completion_tokens:  # cumulative form
            output_ids = output_ids[self.num_ids:]
            logprobs = logprob_pairs(entries[self.num_logprobs:])  # only the new ones
            text = text[self.num_chars:]
        else:
            logprobs = logprob_pairs(entries)
        self.num_ids += len(output_ids)
        self.num_logprobs += len(logprobs)
        self.num_chars += len(text)
        self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
        if meta.get("cached_tokens") is not None:
            self.cached_tokens = meta["cached_tokens"]
            self.storage_tokens = storage_tokens(meta)
        return GenerateChunk(meta.get("id", self.rid), output_ids, text, logprobs, finish,
                             self.prompt_tokens, completion_tokens, self.cached_tokens,
                             meta.get("weight_version"), self.storage_tokens)

    def _queued_abort_ids(self, output_ids: list[int], logprobs: list[tuple[float, int]],
                          completion_tokens: int) -> list[int]:
        """The IDs of a queued abort's reply that the stream has not delivered yet."""
        num_new = completion_tokens - self.num_ids
        if num_new <= 0:
            return []
        if len(output_ids) == completion_tokens:
            return output_ids[self.num_ids:]
        if len(output_ids) >= num_new:
            return output_ids[len(output_ids) - num_new:]
        if len(logprobs) == completion_tokens:
            return [token_id for _, token_id in logprobs[self.num_ids:]]
        raise EngineUnavailable(
            f"request {self.rid} was aborted with {num_new} output IDs the stream never "
            f"delivered and its reply does not hold them; resume it from its partial output")


def latest_events(events: list[dict]) -> list[dict]:
    """`events` (that arrived together, in order) less those the next one holds entirely:
    in SGLang's default (cumulative) form each event holds the whole output so far, so
    an event without a finish reason followed by another cumulative one of the same weight
    version adds nothing to it (the reader takes what is new from the later one). A gateway
    that reads a fast engine's stream gets many events per read; reading only the latest
    keeps its work per read, not per token (each event is a delta through the pool, the
    sampler and the tool parser). Events in the incremental form are all kept."""
    if len(events) == 1:  # the usual read: one event
        return events
    return [event for event, following in zip(events, [*events[1:], None], strict=True)
            if following is None or not _holds(following, event)]


def _holds(later: dict, event: dict) -> bool:
    """Whether cumulative `later` holds all of `event` (unfinished, cumulative too, of
    the same weight version)."""
    meta, later_meta = event.get("meta_info"), later.get("meta_info")
    return (isinstance(meta, dict) and isinstance(later_meta, dict)
            and meta.get("finish_reason") is None
            and _is_cumulative(event, meta) and _is_cumulative(later, later_meta)
            and later_meta["completion_tokens"] >= meta["completion_tokens"]
            and later_meta.get("weight_version") == meta.get("weight_version"))


def _is_cumulative(event: dict, meta: dict) -> bool:
    """An event whose `output_ids` are all its `completion_tokens` (in the incremental form
    only a first one is; its successor then is not, so it is kept)."""
    output_ids = event.get("output_ids")
    return (isinstance(output_ids, list) and isinstance(meta.get("completion_tokens"), int)
            and len(output_ids) == meta["completion_tokens"])
