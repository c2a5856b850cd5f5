"""Run configuration: one YAML file, dotted overrides, one frozen dataclass per part.

Each part (engine, gateway, sandboxes, rollout, learner, pool) defines its own
frozen dataclass in its own package; this module only reads the file, applies
`a.b=c` overrides from the command line, and builds each part's section, so that
no part ever sees the whole tree. A field whose type is itself a dataclass is built
from its nested mapping the same way (`rollout.sandbox.memory_bytes=4294967296`), with
the same errors naming the dotted key.
"""

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def read_config(path: Path | None, overrides: list[str] = ()) -> dict[str, Any]:
    """Reads a YAML mapping (empty when `path` is None) and applies `a.b=value` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: the config must be a mapping, got {type(loaded).__name__}")
        tree = loaded or {}
    for override in overrides:
        apply_override(tree, override)
    return tree


def apply_override(tree: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form section.key=value")
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {part!r} is not a section")
    node[leaf] = yaml.safe_load(raw)


def build_section(cls: type[T], data: dict[str, Any] | None, name: str) -> T:
    """Builds the frozen dataclass `cls` from one section, naming any bad key or value."""
    data = dict(data or {})
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"[{name}] unknown keys {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(hints[key], value, f"{name}.{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping of {hint.__name__}'s fields, "
                             f"got {value!r}")
        return build_section(hint, value, where)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        if any(isinstance(arg, type) and arg not in (Any, float, Path) and isinstance(value, arg)
               and not isinstance(value, bool) for arg in typing.get_args(hint)):
            return value   # e.g. `int | str`: an int or a str is taken as it is
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        origin = typing.get_origin(hint)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return tuple(_coerce(item, v, where) for v in value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is Path and isinstance(value, str):
        return Path(value)
    if isinstance(hint, type) and hint is not Any and not isinstance(value, hint):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value
