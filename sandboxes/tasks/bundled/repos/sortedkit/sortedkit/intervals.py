"""A set of numbers stored as disjoint half-open intervals ``[start, end)``.

Adding an interval merges it with every interval it overlaps or touches, so
the stored intervals are always disjoint, non-empty, sorted and separated by
gaps. Typical uses: free/busy time, byte ranges received, line ranges.
"""

from bisect import bisect_left, bisect_right
from collections.abc import Iterator


class IntervalSet:
    """Disjoint half-open intervals.

    Invariants: ``_starts`` and ``_ends`` have equal length; for every i,
    ``_starts[i] < _ends[i] < _starts[i + 1]`` (there is a real gap between
    neighbours: touching intervals are merged).
    """

    def __init__(self, intervals=()):
        self._starts: list = []
        self._ends: list = []
        for start, end in intervals:
            self.add(start, end)

    def __iter__(self) -> Iterator[tuple]:
        return iter(zip(self._starts, self._ends, strict=True))

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"IntervalSet({list(self)!r})"

    def __contains__(self, point) -> bool:
        index = bisect_right(self._starts, point) - 1
        return index >= 0 and point < self._ends[index]

    def total_length(self):
        return sum(end - start for start, end in self)

    def add(self, start, end) -> None:
        """Add ``[start, end)``, merging it with overlapping or touching intervals."""
        _check(start, end)
        if start == end:
            return
        first = bisect_left(self._ends, start)
        last = bisect_right(self._starts, end)
        if first < last:
            start = min(start, self._starts[first])
            end = max(end, self._ends[last - 1])
        self._starts[first:last] = [start]
        self._ends[first:last] = [end]

    def remove(self, start, end) -> None:
        """Remove ``[start, end)``; parts of intervals outside it are kept."""
        _check(start, end)
        if start == end:
            return
        first = bisect_right(self._ends, start)
        last = bisect_left(self._starts, end)
        if first >= last:
            return
        new_starts, new_ends = [], []
        if self._starts[first] < start:
            new_starts.append(self._starts[first])
            new_ends.append(start)
        if self._ends[last - 1] > end:
            new_starts.append(end)
            new_ends.append(self._ends[last - 1])
        self._starts[first:last] = new_starts
        self._ends[first:last] = new_ends

    def overlaps(self, start, end) -> bool:
        """Return True if any stored interval shares a point with ``[start, end)``."""
        _check(start, end)
        index = bisect_right(self._ends, start)
        return start < end and index < len(self._starts) and self._starts[index] < end

    def gaps(self, start, end) -> list[tuple]:
        """Return the parts of ``[start, end)`` not covered by the set."""
        _check(start, end)
        result = []
        cursor = start
        for interval_start, interval_end in self:
            if interval_end <= cursor:
                continue
            if interval_start >= end:
                break
            if interval_start > cursor:
                result.append((cursor, interval_start))
            cursor = max(cursor, interval_end)
        if cursor < end:
            result.append((cursor, end))
        return result


def _check(start, end) -> None:
    if end < start:
        raise ValueError(f"interval end {end!r} is before its start {start!r}")
