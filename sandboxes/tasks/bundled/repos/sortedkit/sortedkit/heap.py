"""A binary min-heap whose items can change priority or leave early.

Used for schedulers and Dijkstra-style searches, where an item's priority
drops while it waits. Each item must be hashable and appear at most once.
"""

from collections.abc import Hashable
from typing import Any


class IndexedHeap:
    """A min-priority queue with ``update`` and ``remove`` by item.

    Invariants: ``_entries`` is a binary heap of ``[priority, order, item]``
    lists ordered by (priority, order); ``_positions[item]`` is the index of
    that item's entry. ``order`` breaks ties first-in, first-out.
    """

    def __init__(self):
        self._entries: list[list] = []
        self._positions: dict[Hashable, int] = {}
        self._num_pushed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: Hashable) -> bool:
        return item in self._positions

    def push(self, item: Hashable, priority: Any) -> None:
        if item in self._positions:
            raise ValueError(f"{item!r} is already in the heap; use update()")
        self._entries.append([priority, self._num_pushed, item])
        self._num_pushed += 1
        self._positions[item] = len(self._entries) - 1
        self._sift_up(len(self._entries) - 1)

    def peek(self) -> tuple[Hashable, Any]:
        """Return (item, priority) with the smallest priority, without removing it."""
        if not self._entries:
            raise IndexError("peek from an empty heap")
        priority, _, item = self._entries[0]
        return item, priority

    def pop(self) -> tuple[Hashable, Any]:
        """Remove and return (item, priority) with the smallest priority."""
        if not self._entries:
            raise IndexError("pop from an empty heap")
        item, priority = self.peek()
        self._remove_at(0)
        return item, priority

    def priority(self, item: Hashable) -> Any:
        return self._entries[self._positions[item]][0]

    def update(self, item: Hashable, priority: Any) -> None:
        """Change the priority of ``item``, which must be in the heap."""
        index = self._positions[item]
        old_priority = self._entries[index][0]
        self._entries[index][0] = priority
        if priority < old_priority:
            self._sift_up(index)
        else:
            self._sift_down(index)

    def remove(self, item: Hashable) -> None:
        self._remove_at(self._positions[item])

    def _remove_at(self, index: int) -> None:
        last = self._entries.pop()
        del self._positions[last[2]]
        if index == len(self._entries):
            return
        removed = self._entries[index]
        del self._positions[removed[2]]
        self._entries[index] = last
        self._positions[last[2]] = index
        self._sift_up(index)
        self._sift_down(self._positions[last[2]])

    def _less(self, i: int, j: int) -> bool:
        return self._entries[i][:2] < self._entries[j][:2]

    def _swap(self, i: int, j: int) -> None:
        entries = self._entries
        entries[i], entries[j] = entries[j], entries[i]
        self._positions[entries[i][2]] = i
        self._positions[entries[j][2]] = j

    def _sift_up(self, index: int) -> None:
        while index > 0:
            parent = (index - 1) // 2
            if not self._less(index, parent):
                break
            self._swap(index, parent)
            index = parent

    def _sift_down(self, index: int) -> None:
        size = len(self._entries)
        while True:
            smallest = index
            for child in (2 * index + 1, 2 * index + 2):
                if child < size and self._less(child, smallest):
                    smallest = child
            if smallest == index:
                return
            self._swap(index, smallest)
            index = smallest
