"""A least-recently-used cache with a fixed number of entries."""

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass
class CacheStats:
    """Counters since the cache was created or last cleared."""

    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        num_lookups = self.num_hits + self.num_misses
        return self.num_hits / num_lookups if num_lookups else 0.0


class LRUCache:
    """A mapping of at most ``capacity`` entries.

    Reading or writing an entry makes it the most recently used; when a new
    key would exceed the capacity, the least recently used entry is evicted
    and ``on_evict(key, value)`` is called for it. Invariant: the order of
    ``_entries`` is least to most recently used.
    """

    def __init__(self, capacity: int, on_evict: Callable[[Hashable, Any], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._on_evict = on_evict
        self._entries: OrderedDict = OrderedDict()
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        """Membership test; does not count as a use."""
        return key in self._entries

    def get(self, key: Hashable, default: Any = None) -> Any:
        if key not in self._entries:
            self.stats.num_misses += 1
            return default
        self.stats.num_hits += 1
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
        elif len(self._entries) >= self.capacity:
            self._evict_oldest()
        self._entries[key] = value

    def get_or_compute(self, key: Hashable, compute: Callable[[Hashable], Any]) -> Any:
        """Return the cached value, computing and storing it on a miss."""
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = compute(key)
            self.put(key, value)
        return value

    def pop(self, key: Hashable, default: Any = _MISSING) -> Any:
        if key in self._entries:
            return self._entries.pop(key)
        if default is _MISSING:
            raise KeyError(key)
        return default

    def keys(self) -> list:
        """Keys from least to most recently used."""
        return list(self._entries)

    def resize(self, capacity: int) -> None:
        """Change the capacity, evicting the oldest entries if it shrinks."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        while len(self._entries) > capacity:
            self._evict_oldest()

    def clear(self) -> None:
        self._entries.clear()
        self.stats = CacheStats()

    def _evict_oldest(self) -> None:
        key, value = self._entries.popitem(last=False)
        self.stats.num_evictions += 1
        if self._on_evict is not None:
            self._on_evict(key, value)
