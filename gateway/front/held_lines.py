"""Held lines: the log lines of streamed calls that the disk refused (their clients have
the text, and no SDK retries the error event that would end them), kept in memory until it
takes them; the tree store's hold (`store.py`; docs/api.md, "When the store's disk fills").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from undertow.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """One submit's lines: `data`, when they were held (`held_s`, monotonic) and whom to
    tell if they are dropped."""

    data: bytes
    held_s: float
    on_lost: Callable[[str], None]


class HeldLines:
    """Held lines by group, oldest first. Invariant: `num_bytes` is the size of them all,
    at most `max_bytes`; a group is listed only while it has some."""

    def __init__(self, max_bytes: int, max_s: float, metrics: GatewayMetrics):
        if max_bytes < 0 or max_s < 0:
            raise ValueError(f"store_hold_max_bytes={max_bytes} and store_hold_max_s={max_s} "
                             "must be >= 0 (store_hold_max_bytes=0 holds nothing)")
        self.max_bytes, self.max_s, self.metrics = max_bytes, max_s, metrics
        self.num_bytes = 0
        self._by_group: dict[str, list[_Held]] = {}

    def groups(self) -> list[str]:
        return list(self._by_group)

    def has(self, group: str) -> bool:
        return group in self._by_group

    def hold(self, group: str, data: bytes, on_lost: Callable[[str], None]) -> bool:
        """Holds a submit's lines if they fit `max_bytes`; whether it did."""
        if self.num_bytes + len(data) > self.max_bytes:
            log.error("tree store: %d bytes for group %s would take the held lines past "
                      "store_hold_max_bytes=%d; not held", len(data), group, self.max_bytes)
            return False
        self._by_group.setdefault(group, []).append(_Held(data, time.monotonic(), on_lost))
        self._count(len(data))
        return True

    def write_in_order(self, group: str, write: Callable[[bytes], None]) -> None:
        """Writes the group's held lines with `write`, oldest first; what `write` raises
        stops it, the rest still held."""
        held = self._by_group.get(group)
        while held:
            write(held[0].data)
            self._count(-len(held.pop(0).data))
        self._by_group.pop(group, None)

    def waited_s(self, group: str) -> float:
        """How long the group's oldest held line has waited."""
        return time.monotonic() - self._by_group[group][0].held_s

    def drop(self, group: str, reason: str, cause: str) -> None:
        """Drops the group's held lines and tells their owners (`cause`, a few words;
        `reason` goes to the log)."""
        held = self._by_group.pop(group)
        self._count(-sum(len(item.data) for item in held))
        self.metrics.store_dropped_lines.inc(sum(item.data.count(b"\n") for item in held))
        log.error("tree store: dropped the held lines of %d calls of group %s: %s; their "
                  "sessions are infra failures", len(held), group, reason)
        for item in held:
            item.on_lost(f"store: a streamed call's record dropped ({cause})")

    def _count(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        self.metrics.store_held_bytes.set(self.num_bytes)
