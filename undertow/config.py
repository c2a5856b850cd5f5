"""Run configuration: one YAML file, dotted overrides, one frozen dataclass per part.

Each part (engine, gateway, sandboxes, rollout, learner, pool) defines its own
frozen dataclass in its own package; this module only reads the file, applies
`a.b=c` overrides from the command line, and builds each part's section, so that
no part ever sees the whole tree. A field whose type is itself a dataclass is built
from its nested mapping the same way (`rollout.sandbox.memory_bytes=4294967296`), with
the same errors naming the dotted key.
"""

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
# A command's deprecated flags: flag -> (argparse keyword arguments, the dotted key it sets).
Aliases = dict[str, tuple[dict[str, Any], str]]


def read_config(path: Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
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
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping of {cls.__name__}'s fields, got {data!r}")
    data = dict(data or {})
    fields = {field.name: field for field in _fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        dotted = ", ".join(f"{name}.{key}" for key in unknown)
        raise ValueError(f"[{name}] unknown keys {unknown} ({dotted}); known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(hints[key], value, f"{name}.{key}")
    return cls(**kwargs)


def _fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is no dataclass: a config section must be one")
    return dataclasses.fields(cls)


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
        if dataclasses.is_dataclass(hint):   # e.g. `AutoSessionsConfig | None`
            return _coerce(hint, value, where)
        origin = typing.get_origin(hint)
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return tuple(_coerce(item, v, where) for v in value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads `3e-3` (no dot) as a string; Python reads it as the number meant
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where}: expected float, got {value!r}") from None
    if hint is Path and isinstance(value, str):
        return Path(value)
    if hint is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)   # `weight_version=3` on the command line is YAML's int 3
    if isinstance(hint, type) and hint is not Any and not isinstance(value, hint):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def config_keys(cls: type, prefix: str = "", exclude: frozenset[str] = frozenset()) -> list[str]:
    """`key = default` lines of `cls`'s fields, nested dataclasses as dotted keys, for --help."""
    lines = []
    hints = typing.get_type_hints(cls)
    for field in _fields(cls):
        key = prefix + field.name
        if key in exclude:
            continue
        nested = dataclass_of(hints[field.name])
        if nested is not None:
            if field.default is None:   # an optional part, off unless its keys are set
                lines.append(f"  {key} = None")
            lines.extend(config_keys(nested, key + ".", exclude))
        else:
            lines.append(f"  {key} = {_default_text(field)}")
    return lines


def dataclass_of(hint: object) -> type | None:
    """The dataclass `hint` names, alone or in a union with None."""
    candidates = typing.get_args(hint) if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else (hint,)
    return next((arg for arg in candidates
                 if isinstance(arg, type) and dataclasses.is_dataclass(arg)), None)


def _default_text(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "(required)"


def add_config_arguments(parser: argparse.ArgumentParser, load_class: Callable[[], type],
                         exclude: frozenset[str] = frozenset()) -> None:
    """`-c/--config FILE`, positional `KEY=VALUE` overrides and `-h/--help` on `parser` (made
    with `add_help=False`): the help lists the keys of the dataclass `load_class()` returns
    and their defaults, the dataclass's own. `load_class` runs only for --help, so that
    building the parser never imports a heavy module (the engine's torch)."""
    class HelpWithKeys(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: object, option_string: str | None = None) -> None:
            keys = "\n".join(config_keys(load_class(), exclude=exclude))
            print(f"{parser.format_help()}\nconfig keys (KEY=VALUE or -c FILE), with their "
                  f"defaults:\n{keys}")
            parser.exit()

    parser.add_argument("-h", "--help", action=HelpWithKeys, nargs=0,
                        help="show this help and the config keys, then exit")
    parser.add_argument("-c", "--config", type=Path, default=None,
                        help="YAML file of the config keys (nested mappings for dotted keys)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="set a config key (applied after the file)")


def add_alias_flags(parser: argparse.ArgumentParser, aliases: Aliases) -> None:
    """Hidden deprecated flags (flag: (argparse keyword arguments, dotted key)), each setting
    its config key, kept for callers not yet moved to `KEY=VALUE`."""
    for flag, (kwargs, key) in aliases.items():
        parser.add_argument(flag, dest=_alias_dest(key), default=None, help=argparse.SUPPRESS,
                            **kwargs)


def _alias_dest(key: str) -> str:
    return "alias_" + key.replace(".", "__")


def command_config(cls: type[T], args: argparse.Namespace, name: str, flags: dict[str, Any],
                   aliases: Aliases | None = None) -> T:
    """`cls` built from `--config`, then the alias flags given (`add_alias_flags`), then
    the positional overrides; `flags` (key: value, None when not given) are the command's
    own flags, which the file and the overrides may not set."""
    tree = read_config(args.config)
    owned = sorted(set(tree) & set(flags))
    if owned:
        raise ValueError(f"[{name}] {owned} are set by the command's flags, not the config")
    for _, key in (aliases or {}).values():
        value = getattr(args, _alias_dest(key))
        if value is not None:
            _set_key(tree, key, value)
    for override in args.overrides:
        if override.partition("=")[0] in flags:
            raise ValueError(f"[{name}] {override!r}: that key is set by the command's flags")
        apply_override(tree, override)
    tree.update({key: value for key, value in flags.items() if value is not None})
    return build_section(cls, tree, name)


def _set_key(tree: dict[str, Any], key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
