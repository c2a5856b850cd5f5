"""Staged KV imports (Undertow's KV transfer, `undertow_kv.py`): the KV of a sequence that is
migrating here, copied in stages while its source engine keeps decoding, waits in a KV slot of
its own, so that the request which continues it starts in that slot and copies nothing.

Slot layout: running requests hold slots 0..R-1 (the scheduler's invariant), stagings hold the
slots right after them, R..R+S-1, in `entries` order. Each change of R keeps it so, with at most
one staging's KV copied between two steps:
- a request that joins takes slot R; a staging there first moves to the end (`vacate`);
- a staged request takes its own staging's slot, swapped to R first when it is not the first
  staging (`take`; only then does a resume copy KV: several stagings waiting on one engine);
- a request that leaves frees slot R-1 after compaction; the last staging moves into it
  (`fill_hole`).

A staging is named by a random `handle` and records the token IDs it holds and their
`PrefixDigest`. A request that continues it must `claim` it with the same number of tokens and
digest (else it is refused and the staging stays as it was); the claim holds it until the
worker `take`s it at admission (or `unclaim`s it, when the request ends before that). Unclaimed
stagings expire `ttl_s` after their last use, on the next iteration of the worker; a weight
update drops them all (their KV is of the old weights).

Threads: the worker owns the slots and `entries`; `claim` and `unclaim` run on the event loop's
thread, so the handle table and the claim flags are guarded by a lock.
"""

import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from undertow.gateway.builtin_engine.errors import BuiltinEngineError
from undertow.gateway.builtin_engine.model import SlotKV
from undertow.gateway.kv_wire import PrefixDigest

DEFAULT_TTL_S = 120.0


class StagingConflict(BuiltinEngineError):
    """A staging is not in the state a call assumes (HTTP `status`: 404 unknown, 409 other)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class StagedEntry:
    """One staging: the KV of `token_ids` (positions 0..len-1) in its slot.

    Invariants: `digest` is the `PrefixDigest` of `token_ids`; a claimed entry neither grows
    nor expires.
    """

    handle: str
    token_ids: list[int] = field(default_factory=list)
    digest: PrefixDigest = field(default_factory=PrefixDigest)
    touched_s: float = field(default_factory=time.monotonic)
    claimed: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class StagedSlots:
    """The stagings of one scheduler (see module doc); `num_running` is always R."""

    def __init__(self, kv: SlotKV, ttl_s: float = DEFAULT_TTL_S):
        self.kv = kv
        self.ttl_s = ttl_s
        self.entries: list[StagedEntry] = []
        self._handles: dict[str, StagedEntry] = {}
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.entries)

    def stage(self, handle: str | None, start: int, token_ids: list[int], kv: torch.Tensor,
              num_running: int) -> StagedEntry:
        """Worker: a new staging of positions [0, len(token_ids)) (`handle` None), or the
        next span [start, ...) of staging `handle`; `kv` is (layers, 2, kv_heads, n, hd)."""
        end = start + len(token_ids)
        with self._lock:  # check and grow at once: a claim in between would see half of it
            if handle is None:
                if start != 0:
                    raise StagingConflict(f"a new staging begins at position 0, this payload at "
                                          f"{start}; export from start=0 first")
                self.kv.reserve(num_running + len(self.entries) + 1, end + 1)
                entry = StagedEntry(uuid.uuid4().hex)
                self._handles[entry.handle] = entry
                self.entries.append(entry)
            else:
                entry = self._known(handle)
                if entry.claimed:
                    raise StagingConflict(f"staged KV {handle} is claimed by a request that "
                                          "continues from it; it takes no more tokens")
                if start != entry.num_tokens:
                    raise StagingConflict(f"staged KV {handle} holds {entry.num_tokens} tokens; "
                                          f"this payload starts at {start}; export from "
                                          f"start={entry.num_tokens}")
                self.kv.reserve(num_running + len(self.entries), end + 1)
            self.kv.write(num_running + self.entries.index(entry), start, kv)
            entry.token_ids.extend(token_ids)
            entry.digest.update(token_ids)
            entry.touched_s = time.monotonic()
        return entry

    def _known(self, handle: str) -> StagedEntry:
        entry = self._handles.get(handle)
        if entry is None:
            raise StagingConflict(f"no staged KV with handle {handle!r}: it was used, released, "
                                  "expired or dropped by a weight update; stage it again, or "
                                  "send the whole input_ids to /generate", status=404)
        return entry

    def claim(self, handle: str, num_tokens: int, digest: str) -> list[int]:
        """Any thread: reserve staging `handle` for a request continuing the prefix of
        `num_tokens` tokens with `digest`; return its token IDs (not to be modified)."""
        with self._lock:
            entry = self._known(handle)
            if entry.claimed:
                raise StagingConflict(f"staged KV {handle} is already claimed by another request")
            if (num_tokens, digest) != (entry.num_tokens, entry.digest.hexdigest()):
                raise StagingConflict(
                    f"staged KV {handle} holds another prefix ({entry.num_tokens} tokens, digest "
                    f"{entry.digest.hexdigest()}) than the request continues ({num_tokens} tokens,"
                    f" digest {digest}); it is kept as it was; send the whole input_ids to "
                    "/generate, or name the staging of this sequence")
            entry.claimed = True
            return entry.token_ids

    def unclaim(self, handle: str) -> None:
        """Any thread: the request that claimed `handle` ended before taking it."""
        with self._lock:
            entry = self._handles.get(handle)
            if entry is not None:
                entry.claimed = False
                entry.touched_s = time.monotonic()

    def take(self, handle: str, num_running: int) -> StagedEntry | None:
        """Worker, admitting the request that claimed `handle`: its staging, now in slot
        `num_running` and no longer a staging; None when it was dropped meanwhile."""
        with self._lock:
            entry = self._handles.pop(handle, None)
        if entry is None:
            return None
        index = self.entries.index(entry)
        if index:
            first = self.entries[0]
            saved = self.kv.read(num_running, 0, first.num_tokens)  # a copy
            self.kv.move(num_running + index, num_running, entry.num_tokens)
            self.kv.write(num_running + index, 0, saved)
            self.entries[0], self.entries[index] = entry, first
        self.entries.pop(0)
        return entry

    def vacate(self, num_running: int) -> None:
        """Worker: slot `num_running` is about to be taken by a joining request."""
        if not self.entries:
            return
        first = self.entries.pop(0)
        end_slot = num_running + len(self.entries) + 1
        self.kv.reserve(end_slot + 1, first.num_tokens)
        self.kv.move(num_running, end_slot, first.num_tokens)
        self.entries.append(first)

    def fill_hole(self, num_running: int) -> None:
        """Worker: a running request left and compaction freed slot `num_running`."""
        if not self.entries:
            return
        last = self.entries.pop()
        self.kv.move(num_running + len(self.entries) + 1, num_running, last.num_tokens)
        self.entries.insert(0, last)

    def release(self, handle: str, num_running: int) -> None:
        """Worker: free staging `handle` (a request that claimed it must end first)."""
        with self._lock:
            entry = self._known(handle)
            if entry.claimed:
                raise StagingConflict(f"staged KV {handle} is claimed by a request; it is freed "
                                      "when that request ends")
            del self._handles[handle]
        index, last = self.entries.index(entry), len(self.entries) - 1
        if index != last:
            moved = self.entries[last]
            self.kv.move(num_running + last, num_running + index, moved.num_tokens)
            self.entries[index] = moved
        self.entries.pop()

    def expire(self, num_running: int) -> None:
        """Worker: release the unclaimed stagings unused for `ttl_s`."""
        if not self.entries:
            return
        deadline = time.monotonic() - self.ttl_s
        for entry in [e for e in self.entries if not e.claimed and e.touched_s < deadline]:
            self.release(entry.handle, num_running)

    def drop_all(self) -> None:
        """Worker: forget every staging (their slots come after the running ones: no move)."""
        with self._lock:
            self._handles.clear()
        self.entries.clear()
