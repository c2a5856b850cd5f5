"""Continuous batching: one worker thread admits, prefills and decodes every running request.

Each iteration of the worker's loop: take newly arrived requests and commands (abort, pause,
continue, weight swap, flush) and apply the commands, so that every state change, weight
updates included, happens between two model steps; then admit waiting requests while fewer than
`max_running_requests` run (look up the prefix cache, copy the cached KV into a free slot,
prefill the rest alone, sample the first token); then run one decode step for all running
requests together; finished requests leave the batch at once (their KV goes into the prefix
cache, their slot is refilled by compaction) and the next waiting request joins on the next
iteration. A request that continues a staged KV import (`staging.py`, a migration's) starts in
that import's slot instead of copying from the cache, and when only its last token is not
staged it skips the prefill and joins the decode step as if it had been running all along.
Outputs are handed to `publish` once per iteration, as (request, number of output tokens,
finished) snapshots; `publish` must be thread-safe (the server posts them to its event loop),
so the torch work never runs on the event loop.

Chunked prefill (SGLang's `--chunked-prefill-size`): a long prompt is prefilled one chunk per
iteration between the others' decode steps; how a chunk is sized and why: docs/engines.md,
"The built-in engine".
"""

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable

import torch

from undertow.gateway.builtin_engine.grammar import mask_logits
from undertow.gateway.builtin_engine.model import CausalLM, PrefillSpan, SlotKV, Weights
from undertow.gateway.builtin_engine.radix_cache import RadixCache
from undertow.gateway.builtin_engine.request import Request
from undertow.gateway.builtin_engine.sampling import sample
from undertow.gateway.builtin_engine.staging import StagedSlots

log = logging.getLogger(__name__)

Update = tuple[Request, int, bool]


class Scheduler:
    """Owns the running batch, the waiting queue, the KV slots, the staged KV imports and
    the prefix cache.

    Invariants: `running[i]` occupies KV slot i, `staged.entries[j]` slot len(running) + j;
    `chunking`, when set, is `running[-1]`, and it alone has KV for fewer than all but the
    last of its tokens; only the worker thread touches the model, the slots and the cache;
    other threads call `add`, `call`, `staged.claim` and read the counters.
    """

    def __init__(self, model: CausalLM, cache: RadixCache, decode: Callable[[list[int]], str],
                 eos_token_ids: frozenset[int], max_running_requests: int,
                 publish: Callable[[list[Update]], None], weight_version: str,
                 max_prefill_tokens: int = 16384, chunked_prefill_size: int = 0):
        self.model, self.cache, self.decode_text = model, cache, decode
        self.eos_token_ids = eos_token_ids
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size  # <= 0: prompts are prefilled whole
        self.attention_tokens = attention_tokens(model.config)
        self.chunking: Request | None = None  # the request prefilled in chunks: running[-1]
        self.publish = publish
        self.weight_version = weight_version
        self.context_length = model.config.max_position_embeddings
        self.kv = SlotKV(model.config, model.device, model.dtype)
        self.staged = StagedSlots(self.kv)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused = False
        self.epoch = 0
        self.num_steps = 0
        self._inbox: list[Request] = []
        self._commands: list[tuple[Callable, concurrent.futures.Future]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._updates: dict[Request, None] = {}
        self._thread = threading.Thread(target=self._loop, name="undertow-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, request: Request) -> None:
        """Queue a request (any thread)."""
        with self._wake:
            self._inbox.append(request)
            self._wake.notify()

    def call(self, command: Callable) -> concurrent.futures.Future:
        """Run `command()` on the worker between two steps (any thread); its result comes back."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._commands.append((command, future))
            self._wake.notify()
        return future

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def _loop(self) -> None:
        with torch.inference_mode():
            self._run()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self._commands
                           or (not self.paused and (self.waiting or self.running))):
                    self._wake.wait()
                if self._stopping:
                    return
                self.waiting.extend(self._inbox)
                commands, self._inbox, self._commands = self._commands, [], []
            for command, future in commands:
                # A caller that gave up first (its awaiting task was cancelled, which
                # cancels the future) gets nothing; setting a cancelled future's result
                # raises, which ended this thread: the engine then never generated again.
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(command())
                except Exception as error:  # the caller gets it through the future
                    future.set_exception(error)
            self.staged.expire(len(self.running))
            if not self.paused:
                self._admit()
                if self.chunking is not None:
                    self._continue_prefill(self.chunking)
                if len(self.running) > (self.chunking is not None):
                    self._step()
            self._flush_updates()

    def _flush_updates(self) -> None:
        if self._updates:
            updates = [(r, len(r.output_ids), r.finish_reason is not None) for r in self._updates]
            self._updates = {}
            self.publish(updates)

    def _note(self, request: Request) -> None:
        if request.stream or request.finish_reason is not None:
            self._updates[request] = None

    def _admit(self) -> None:
        """Place waiting requests in slots, then prefill those whose whole prompt goes in one
        pass together (`CausalLM.prefill_many`: each linear layer's weights read once for all
        of them, not once per request)."""
        budget = self.max_prefill_tokens
        whole: list[Request] = []
        while (self.chunking is None and self.waiting
               and len(self.running) < self.max_running_requests and budget > 0):
            request = self.waiting.popleft()
            try:
                if self._place(request):
                    whole.append(request)
            except Exception as error:
                self._prefill_failed(request, error)
            budget -= len(request.input_ids) - request.cached_tokens
        if whole:
            self._run_prefill([(r, len(r.all_ids) - r.kv_length) for r in whole])

    def _prefill_failed(self, request: Request, error: Exception) -> None:
        log.exception("prefill of %s failed", request.rid)
        self._retire(request, _abort(f"prefill failed: {error}"))

    def _place(self, request: Request) -> bool:
        """Give `request` the next slot with its staged or cached prefix; True when the rest of
        its prompt is to be prefilled whole now (else it is staged up to its last token and
        joins the next decode step, or it becomes `chunking`)."""
        ids = request.all_ids
        if not request.output_ids:  # a retracted request's logprobs are recorded anew
            request.input_logprobs.clear()
            request.input_top_logprobs.clear()
        slot = len(self.running)
        idle = not self.running  # no other request decodes (`chunk_length`)
        request.epoch = self.epoch
        start = self._take_staged(request, slot)
        staged = start is not None
        if start is None:
            start = self._reuse_cached(request, ids, slot)
        self.kv.reserve(slot + 1, len(ids) + 1)
        request.kv_length = start
        self.running.append(request)
        if staged and start == len(ids) - 1 and request.params.max_new_tokens:
            return False  # all but its last token staged: no prefill
        if self.chunk_length(start, len(ids) - start, idle) < len(ids) - start:
            self.chunking = request  # `_continue_prefill` runs its chunks, one per iteration
            return False
        return True

    def chunk_length(self, start: int, num_tokens: int, idle: bool = False) -> int:
        """How many of `num_tokens` prompt tokens after `start` prefilled ones go into the next
        chunk: all when chunking is off, else the most whose cost stays within
        `chunked_prefill_size` token equivalents, or `max_prefill_tokens` when `idle` (no other
        request decodes), and at least one."""
        if self.chunked_prefill_size <= 0:
            return num_tokens
        size = max(self.max_prefill_tokens, self.chunked_prefill_size) if idle else \
            self.chunked_prefill_size
        scale = self.attention_tokens
        low, high = 1, num_tokens
        while low < high:  # the cost grows with n: the largest n within the size
            n = (low + high + 1) // 2
            if n * (scale + start + n) <= size * scale:
                low = n
            else:
                high = n - 1
        return low

    def _continue_prefill(self, request: Request) -> None:
        num_left = len(request.all_ids) - request.kv_length
        num_tokens = self.chunk_length(request.kv_length, num_left, len(self.running) == 1)
        if num_tokens == num_left:
            self.chunking = None
        self._run_prefill([(request, num_tokens)])

    def _run_prefill(self, parts: list[tuple[Request, int]]) -> None:
        """`_prefill_chunks`, failing every request of `parts` if the pass fails."""
        try:
            self._prefill_chunks(parts)
        except Exception as error:
            for request, _ in parts:
                if request is self.chunking:
                    self.chunking = None
                if request.finish_reason is None:
                    self._prefill_failed(request, error)

    def _prefill_chunks(self, parts: list[tuple[Request, int]]) -> None:
        """Prefill the next `num_tokens` prompt tokens of each running (request, num_tokens)
        in one pass; each whose prompt they end samples its first token (or finishes, for
        max_new_tokens=0)."""
        spans, firsts = [], []
        for request, num_tokens in parts:
            ids, start = request.all_ids, request.kv_length
            done = start + num_tokens == len(ids)
            first = num_tokens - 1 if done else num_tokens  # logit rows wanted from the chunk
            if not request.output_ids and request.wants_input_logprobs:
                first = min(first, max(max(request.logprob_start_len, 1) - 1 - start, 0))
            spans.append(PrefillSpan(self.running.index(request), ids[start:start + num_tokens],
                                     start, slice(first, None)))
            firsts.append(start + first)
        first_tokens: list[tuple[Request, torch.Tensor]] = []
        for (request, num_tokens), logits, position in zip(
                parts, self.model.prefill_many(self.kv, spans), firsts, strict=True):
            fresh = not request.output_ids
            request.kv_length += num_tokens
            done = request.kv_length == len(request.all_ids)
            if fresh and request.wants_input_logprobs:
                self._record_input_logprobs(request, logits[:len(logits) - done], position)
            if not done:
                continue
            if fresh and request.params.max_new_tokens == 0:
                self._retire(request, {"type": "length", "length": 0})
            else:
                first_tokens.append((request, logits[-1:]))
        if first_tokens:
            self._sample([r for r, _ in first_tokens], torch.cat([t for _, t in first_tokens]))

    def _take_staged(self, request: Request, slot: int) -> int | None:
        """For a request that claimed a staged import: move it into `slot` and return how
        many positions it holds; None otherwise (or when a weight update dropped it)."""
        handle, request.staged_handle = request.staged_handle, None
        entry = None if handle is None else self.staged.take(handle, slot)
        if entry is None:
            return None
        if not request.output_ids:
            request.cached_tokens = entry.num_tokens
        return entry.num_tokens

    def _reuse_cached(self, request: Request, ids: list[int], slot: int) -> int:
        """Copy the longest cached prefix of `ids` into `slot` (locked while the request
        runs); return its length."""
        fresh = not request.output_ids
        max_match = len(ids) - 1
        if fresh and request.wants_input_logprobs:
            max_match = min(max_match, max(request.logprob_start_len - 1, 0))
        match = self.cache.match(ids, max_match)
        self.cache.lock(match)
        request.match = match
        if fresh:
            request.cached_tokens = match.length
        self.staged.vacate(slot)
        self.kv.reserve(slot + 1, len(ids) + 1)
        for position, kv in self.cache.spans(match):  # node by node: no concatenated copy
            self.kv.write(slot, position, kv)
        return match.length

    def _record_input_logprobs(self, request: Request, logits: torch.Tensor,
                               position: int) -> None:
        """Append the logprobs of the prompt tokens at positions position+1.. (row i of
        `logits` is position + i's); the first prompt token's is None."""
        if not request.input_logprobs and request.logprob_start_len == 0:
            request.input_logprobs.append(None)
            if request.top_logprobs_num:
                request.input_top_logprobs.append(None)
        if not len(logits):
            return
        targets = torch.tensor(request.input_ids[position + 1:position + 1 + len(logits)],
                               dtype=torch.long)
        logprobs = torch.log_softmax(logits, -1)
        request.input_logprobs += logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        if request.top_logprobs_num:
            values, indices = logprobs.topk(request.top_logprobs_num, -1)
            request.input_top_logprobs += [
                list(zip(v, i, strict=True))
                for v, i in zip(values.tolist(), indices.tolist(), strict=True)]

    def _step(self) -> None:
        rows = self.running[:-1] if self.chunking is not None else self.running
        positions = [r.kv_length for r in rows]
        self.kv.reserve(len(rows), max(positions) + 1)
        logits = self.model.decode(self.kv, [r.last_id for r in rows], positions)
        for r in rows:
            r.kv_length += 1
        self.num_steps += 1
        self._sample(list(rows), logits)

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> None:
        for i, r in enumerate(rows):
            if len(r.output_ids) < r.params.min_new_tokens:
                banned = list((set() if r.params.ignore_eos else self.eos_token_ids)
                              | r.params.stop_token_ids)
                logits[i, banned] = float("-inf")
        constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            mask_logits(logits, constrained)
        num_top = max((r.top_logprobs_num for r in rows if r.return_logprob), default=0)
        result = sample(logits, [r.params for r in rows], [r.generator for r in rows], num_top)
        finished = []
        for i, r in enumerate(rows):
            if r.grammar is not None:
                r.grammar.accept(result.token_ids[i])
            r.output_ids.append(result.token_ids[i])
            r.output_logprobs.append(result.logprobs[i])
            if result.top_logprobs is not None and r.top_logprobs_num and r.return_logprob:
                r.output_top_logprobs.append(result.top_logprobs[i][:r.top_logprobs_num])
            reason = self._stop_reason(r)
            if reason is None:
                self._note(r)
            else:
                finished.append((r, reason))
        for r, reason in finished:
            self._retire(r, reason)

    def _stop_reason(self, r: Request) -> dict | None:
        token, p = r.output_ids[-1], r.params
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return {"type": "stop", "matched": token}
        if p.stop:
            window = max(len(s) for s in p.stop) + 1
            tail = self.decode_text(r.output_ids[-window:])
            for stop in p.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        if r.kv_length + 1 >= self.context_length:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _retire(self, request: Request, reason: dict | None, cache_kv: bool = True,
                release: bool = True) -> None:
        """Finish `request` (or, with reason None, send it back to waiting: retract); its KV
        goes into the prefix cache unless not `cache_kv`; the slots' memory is freed when
        nothing is left in them, unless not `release` (then `release_idle` does it)."""
        if request in self.running:
            slot = self.running.index(request)
            if cache_kv and request.epoch == self.epoch:
                self.cache.insert(request.all_ids[:request.kv_length],
                                  lambda start, end: self.kv.read(slot, start, end))
            self._vacate(slot)
            self.staged.fill_hole(len(self.running))
            if release:
                self.release_idle()
        if request.staged_handle is not None:  # it claimed a staged import, never admitted
            self.staged.unclaim(request.staged_handle)
            request.staged_handle = None
        if request.match is not None:
            self.cache.unlock(request.match)
            request.match = None
            self.cache.evict()
        request.kv_length = 0
        if reason is None:
            return
        request.finish_reason = reason
        self._note(request)

    def _vacate(self, slot: int) -> None:
        """Drop `running[slot]`; the last running request moves into its slot, except that
        a chunked one stays last (the last decoding one moves, then it moves down by one)."""
        if self.running[slot] is self.chunking:
            self.chunking = None
        last = len(self.running) - 1
        if self.chunking is not None and slot < last - 1:
            self._move(last - 1, slot)
            slot = last - 1
        if slot != last:
            self._move(last, slot)
        self.running.pop()

    def _move(self, source: int, target: int) -> None:
        self.kv.move(source, target, self.running[source].kv_length)
        self.running[target] = self.running[source]

    # Commands: run on the worker through `call`.

    def abort(self, rid: str | None, message: str = "Abort by user request",
              request: Request | None = None) -> int:
        """Abort the request `rid`, or `request`, or every request when both are None;
        return how many were aborted. An aborted request keeps its partial output."""
        victims = [r for r in (*self.waiting, *self.running)
                   if (request is None or r is request) and (rid is None or r.rid == rid)]
        for request in victims:
            if request in self.waiting:
                self.waiting.remove(request)
            self._retire(request, _abort(message))
        return len(victims)

    def stop_migrated(self, request: Request) -> None:
        """Abort `request`, whose KV has moved to another engine: it is not cached here, and
        the slots' memory is not freed now (freeing a long context's takes milliseconds)
        but by a later `release_idle`, once the request's last KV and its stream's end have
        been sent."""
        self._retire(request, _abort("Abort: migrated to another engine (Undertow KV "
                                     "transfer)"), cache_kv=False, release=False)

    def release_idle(self) -> None:
        """Free the slots' memory when no request runs and no staged import waits."""
        if not self.running and not self.staged.entries:
            self.kv.release()

    def pause(self, mode: str) -> int:
        """SGLang's pause modes: abort all, retract all to waiting, or keep all in place."""
        self.paused = True
        if mode == "abort":
            return self.abort(None, "Abort by pause_generation")
        if mode == "retract":
            retracted = list(self.running)
            for request in reversed(retracted):
                self._retire(request, None)
            self.waiting.extendleft(reversed(retracted))
            return len(retracted)
        return len(self.running)

    def resume(self) -> None:
        self.paused = False

    def swap_weights(self, weights: Weights, weight_version: str | None) -> None:
        """Use `weights` from the next step on; the cached KV of the old weights is dropped."""
        self.model.weights = weights
        self.epoch += 1
        self.cache.flush()
        self.staged.drop_all()
        self.release_idle()
        if weight_version is not None:
            self.weight_version = weight_version

    def flush_cache(self) -> None:
        self.cache.flush()


def attention_tokens(config) -> int:
    """The prefix length at which a prompt token's attention costs what its linear layers
    cost: their multiply-adds per token over twice attention's per key (q.k and p.v, counted
    twice for the masked attention path a chunk after a prefix takes on CPU)."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    linear = config.hidden_size * (2 * q_size + 2 * kv_size + 3 * config.intermediate_size)
    return max(1, linear // (4 * q_size))


def _abort(message: str) -> dict:
    return {"type": "abort", "message": message}
