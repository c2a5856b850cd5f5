"""A list that keeps itself sorted.

Items are kept in one Python list, ordered by ``key(item)`` (the item itself
when no key is given). Lookups bisect a parallel list of keys, so adding is
O(n) and searching O(log n): fine for the few-thousand-item lists this
package is meant for.
"""

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def _identity(item: Any) -> Any:
    return item


class SortedList:
    """A sorted sequence.

    Invariants: ``_keys[i] == key(_items[i])`` for every i, and ``_keys`` is
    sorted. Items with equal keys keep their insertion order.
    """

    def __init__(self, iterable: Iterable = (), key: Callable[[Any], Any] | None = None):
        self._key = key or _identity
        self._items: list = []
        self._keys: list = []
        self.update(iterable)

    @property
    def key(self) -> Callable[[Any], Any]:
        return self._key

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __reversed__(self) -> Iterator:
        return reversed(self._items)

    def __getitem__(self, index):
        return self._items[index]

    def __contains__(self, item: Any) -> bool:
        return self._find(item) is not None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SortedList):
            return self._items == other._items
        return NotImplemented

    def __repr__(self) -> str:
        return f"SortedList({self._items!r})"

    def add(self, item: Any) -> None:
        """Insert ``item`` after any items with an equal key."""
        item_key = self._key(item)
        index = bisect_right(self._keys, item_key)
        self._keys.insert(index, item_key)
        self._items.insert(index, item)

    def update(self, iterable: Iterable) -> None:
        """Add every item of ``iterable``."""
        new_items = list(iterable)
        if not new_items:
            return
        if len(new_items) > len(self._items):
            # Re-sorting everything at once is much cheaper than many inserts.
            merged = sorted(self._items + new_items, key=self._key)
            self._items = merged
            self._keys = [self._key(item) for item in merged]
            return
        for item in new_items:
            self.add(item)

    def remove(self, item: Any) -> None:
        """Remove one occurrence of ``item``; raise ValueError if absent."""
        index = self._find(item)
        if index is None:
            raise ValueError(f"{item!r} is not in the list")
        del self._items[index]
        del self._keys[index]

    def discard(self, item: Any) -> None:
        """Remove one occurrence of ``item`` if present."""
        index = self._find(item)
        if index is not None:
            del self._items[index]
            del self._keys[index]

    def pop(self, index: int = -1) -> Any:
        """Remove and return the item at ``index`` (the largest by default)."""
        self._keys.pop(index)
        return self._items.pop(index)

    def index(self, item: Any) -> int:
        """Return the position of the first occurrence of ``item``."""
        index = self._find(item)
        if index is None:
            raise ValueError(f"{item!r} is not in the list")
        return index

    def count(self, item: Any) -> int:
        item_key = self._key(item)
        start = bisect_left(self._keys, item_key)
        end = bisect_right(self._keys, item_key)
        return sum(1 for other in self._items[start:end] if other == item)

    def bisect_left(self, item: Any) -> int:
        return bisect_left(self._keys, self._key(item))

    def bisect_right(self, item: Any) -> int:
        return bisect_right(self._keys, self._key(item))

    def irange(
        self,
        minimum: Any = None,
        maximum: Any = None,
        inclusive: tuple[bool, bool] = (True, True),
    ) -> Iterator:
        """Iterate over items whose keys lie between the keys of ``minimum`` and ``maximum``.

        ``None`` leaves that side open; ``inclusive`` says whether each bound
        itself is included.
        """
        start, end = 0, len(self._keys)
        if minimum is not None:
            min_key = self._key(minimum)
            if inclusive[0]:
                start = bisect_left(self._keys, min_key)
            else:
                start = bisect_right(self._keys, min_key)
        if maximum is not None:
            max_key = self._key(maximum)
            if inclusive[1]:
                end = bisect_right(self._keys, max_key)
            else:
                end = bisect_left(self._keys, max_key)
        return iter(self._items[start:end])

    def copy(self) -> "SortedList":
        """Return an independent SortedList with the same items and key."""
        new = SortedList(key=self._key)
        new._items = list(self._items)
        new._keys = list(self._keys)
        return new

    def _find(self, item: Any) -> int | None:
        # Several items may share a key; scan the run of equal keys for the item.
        item_key = self._key(item)
        index = bisect_left(self._keys, item_key)
        while index < len(self._keys) and self._keys[index] == item_key:
            if self._items[index] == item:
                return index
            index += 1
        return None

