"""A dict whose keys iterate in sorted order.

Values live in a plain dict; the order of the keys is kept by a
:class:`SortedList` beside it, so both must always hold the same keys.
"""

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from sortedkit.sortedlist import SortedList

_MISSING = object()


class SortedDict:
    """A mapping iterated in key order (by ``key(k)`` if a key function is given).

    Invariant: ``set(self._keys) == set(self._values)``.
    """

    def __init__(
        self,
        items: Mapping | Iterable[tuple[Any, Any]] = (),
        key: Callable[[Any], Any] | None = None,
    ):
        self._values: dict = dict(items)
        self._keys = SortedList(self._values, key=key)

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator:
        return iter(self._keys)

    def __contains__(self, key: Any) -> bool:
        return key in self._values

    def __getitem__(self, key: Any) -> Any:
        return self._values[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self._values:
            self._keys.add(key)
        self._values[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._values[key]
        self._keys.remove(key)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SortedDict):
            return self.items() == other.items()
        return NotImplemented

    def __repr__(self) -> str:
        return f"SortedDict({self.items()!r})"

    def get(self, key: Any, default: Any = None) -> Any:
        return self._values.get(key, default)

    def keys(self) -> list:
        return list(self._keys)

    def values(self) -> list:
        return [self._values[key] for key in self._keys]

    def items(self) -> list[tuple[Any, Any]]:
        return [(key, self._values[key]) for key in self._keys]

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        if key not in self._values:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._keys.remove(key)
        return self._values.pop(key)

    def popitem(self, last: bool = True) -> tuple[Any, Any]:
        """Remove and return the largest (or, with ``last=False``, smallest) item."""
        if not self._values:
            raise KeyError("popitem(): dictionary is empty")
        key = self._keys.pop(-1 if last else 0)
        return key, self._values.pop(key)

    def peekitem(self, index: int = -1) -> tuple[Any, Any]:
        key = self._keys[index]
        return key, self._values[key]

    def irange(self, minimum: Any = None, maximum: Any = None, inclusive=(True, True)) -> Iterator:
        """Iterate over the keys between ``minimum`` and ``maximum``."""
        return self._keys.irange(minimum, maximum, inclusive)

    def copy(self) -> "SortedDict":
        """Return an independent SortedDict with the same items and key."""
        new = SortedDict.__new__(SortedDict)
        new._values = dict(self._values)
        new._keys = self._keys.copy()
        return new
