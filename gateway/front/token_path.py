"""Token paths: the prompt IDs of a session's calls, sharing their history instead of
copying it. Call k+1 sends call k's prompt, its sampled IDs and a few thousand new ones; as
flat lists each prompt and head would copy the whole history (8 MB and a million reference
counts per call at a million tokens), so a call costs what it adds only as a `TokenPath`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import overload


class TokenPath(Sequence[int]):
    """Token IDs in immutable chunks: `extend` makes a new path sharing every chunk of
    the old one, so any number of calls and heads may hold and extend one path and none
    can change what another holds. Reads are what a list gives (`len`, indexing, slices
    as new lists, iteration, `==` with any sequence, `+` as a new list); `prefix` is a
    shorter path sharing the chunks. Invariants: `_chunks` are non-empty tuples, never
    changed; `_starts[i]` is the index of `_chunks[i]`'s first ID, `_length` the number
    of IDs."""

    __slots__ = ("_chunks", "_length", "_starts")

    def __init__(self, chunks: tuple[tuple[int, ...], ...] = (),
                 starts: tuple[int, ...] = (), length: int = 0):
        self._chunks, self._starts, self._length = chunks, starts, length

    @classmethod
    def of(cls, token_ids: Iterable[int]) -> TokenPath:
        """A path of `token_ids` (copied once, so the caller may change them afterwards;
        a path is returned as it is)."""
        return token_ids if isinstance(token_ids, TokenPath) else cls().extend(token_ids)

    def extend(self, token_ids: Iterable[int]) -> TokenPath:
        """This path followed by `token_ids`, sharing this path's chunks."""
        chunk = tuple(token_ids)
        if not chunk:
            return self
        return TokenPath(self._chunks + (chunk,), self._starts + (self._length,),
                         self._length + len(chunk))

    def prefix(self, num_tokens: int) -> TokenPath:
        """The first `num_tokens` IDs, sharing the chunks before the cut."""
        if num_tokens >= self._length:
            return self
        if num_tokens <= 0:
            return TokenPath()
        index = bisect.bisect_right(self._starts, num_tokens - 1) - 1
        cut = self._chunks[index][:num_tokens - self._starts[index]]
        return TokenPath(self._chunks[:index] + (cut,), self._starts[:index + 1], num_tokens)

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._chunks)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._slice(*index.indices(self._length)[:2], index.step)
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"token path index {index} out of range ({self._length} IDs)")
        chunk = bisect.bisect_right(self._starts, index) - 1
        return self._chunks[chunk][index - self._starts[chunk]]

    def _slice(self, start: int, stop: int, step: int | None) -> list[int]:
        """IDs `start` to `stop` as a new list, reading only the chunks they lie in."""
        if step not in (None, 1):
            return list(self)[start:stop:step]
        if start >= stop:
            return []
        first = bisect.bisect_right(self._starts, start) - 1
        result: list[int] = []
        for index in range(first, len(self._chunks)):
            begin = self._starts[index]
            if begin >= stop:
                break
            result += self._chunks[index][max(0, start - begin):stop - begin]
        return result

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenPath) and other._chunks == self._chunks:
            return True
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self._length and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    def __add__(self, other: Iterable[int]) -> list[int]:
        return [*self, *other]

    def __radd__(self, other: Iterable[int]) -> list[int]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"TokenPath({self._length} IDs in {len(self._chunks)} chunks)"
