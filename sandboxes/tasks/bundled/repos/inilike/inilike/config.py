"""The :class:`Config` object: a parsed document and typed access to it."""

import copy
from typing import Any

from inilike.errors import ConfigError, MissingKeyError
from inilike.interpolate import Interpolator

_MISSING = object()
TRUE_WORDS = {"true", "yes", "on", "1"}
FALSE_WORDS = {"false", "no", "off", "0"}


class Config:
    """A configuration document.

    The data is a tree of plain dicts: a section is a dict, anything else is a
    value (str, int, float, bool or list). Keys never contain dots; a dotted
    path such as ``"server.tls.cert"`` walks the tree. String values are stored
    raw and their ``${...}`` references are expanded when they are read.
    """

    def __init__(self, data: dict | None = None):
        self._data = data if data is not None else {}
        self._interpolator = Interpolator(self._lookup_raw)

    def __contains__(self, path: str) -> bool:
        try:
            self._lookup_raw(path)
        except MissingKeyError:
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._data == other._data

    def __repr__(self) -> str:
        return f"Config({self._data!r})"

    def get(self, path: str, default: Any = _MISSING, *, interpolate: bool = True) -> Any:
        """Return the value at ``path``, or ``default`` if given and the key is absent."""
        try:
            raw = self._lookup_raw(path)
        except MissingKeyError:
            if default is _MISSING:
                raise
            return default
        if isinstance(raw, dict):
            raise ConfigError(f"'{path}' is a section; use section('{path}') to read it")
        if interpolate and isinstance(raw, str):
            return self._interpolator.expand(raw, path.rpartition(".")[0])
        return raw

    def get_int(self, path: str, default: Any = _MISSING) -> int:
        value = self.get(path, default)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"'{path}' is {value!r}, not an integer")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"'{path}' is {value!r}, not an integer") from None

    def get_float(self, path: str, default: Any = _MISSING) -> float:
        value = self.get(path, default)
        if isinstance(value, bool):
            raise ConfigError(f"'{path}' is {value!r}, not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"'{path}' is {value!r}, not a number") from None

    def get_bool(self, path: str, default: Any = _MISSING) -> bool:
        value = self.get(path, default)
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        raise ConfigError(f"'{path}' is {value!r}, not true or false")

    def get_list(self, path: str, default: Any = _MISSING) -> list:
        """Return a list; a string value is split on commas."""
        value = self.get(path, default)
        if isinstance(value, list):
            return list(value)
        if isinstance(value, str):
            if not value.strip():
                return []
            return [item.strip() for item in value.split(",")]
        return [value]

    def section(self, path: str) -> "Config":
        """Return the section at ``path`` as a Config that shares this one's data."""
        table = self._lookup_raw(path)
        if not isinstance(table, dict):
            raise ConfigError(f"'{path}' is a value, not a section")
        return Config(table)

    def sections(self) -> list[str]:
        """Return the dotted names of all sections, parents before children."""
        names = []

        def walk(table: dict, prefix: str) -> None:
            for key, value in table.items():
                if isinstance(value, dict):
                    names.append(prefix + key)
                    walk(value, prefix + key + ".")

        walk(self._data, "")
        return names

    def set(self, path: str, value: Any) -> None:
        """Set ``path`` to ``value``, creating missing sections on the way."""
        *parents, key = path.split(".")
        table = self._data
        for name in parents:
            table = table.setdefault(name, {})
            if not isinstance(table, dict):
                raise ConfigError(f"cannot set '{path}': '{name}' is a value")
        table[key] = value

    def merge(self, other: "Config") -> "Config":
        """Return a new Config with ``other``'s values laid over this one's.

        Sections are merged key by key; neither input is changed.
        """
        merged = copy.deepcopy(self._data)
        _merge_into(merged, other._data)
        return Config(merged)

    def to_dict(self, interpolate: bool = True) -> dict:
        """Return a deep copy of the data, with references expanded by default."""

        def convert(table: dict, prefix: str) -> dict:
            result = {}
            for key, value in table.items():
                if isinstance(value, dict):
                    result[key] = convert(value, prefix + key + ".")
                elif interpolate and isinstance(value, str):
                    result[key] = self.get(prefix + key)
                else:
                    result[key] = copy.deepcopy(value)
            return result

        return convert(self._data, "")

    def _lookup_raw(self, path: str) -> Any:
        node: Any = self._data
        for name in path.split("."):
            if not isinstance(node, dict) or name not in node:
                raise MissingKeyError(f"no key '{path}' in the configuration")
            node = node[name]
        return node


def _merge_into(target: dict, source: dict) -> None:
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
