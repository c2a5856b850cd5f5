"""The Undertow code as `tests/test_design.py` reads it, with `ast` and without importing
it: each module's top-level names, every class with its members and bases, and what a
dotted name of docs/design.md (`RunLoop.run`, `sections.load_sections`, `loss.sequence_mask`)
names. Modules and their syntax trees come from `tests/test_layering.py`."""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
import sys
import tomllib
from pathlib import Path

from tests.test_layering import _resolve, _sources, _syntax

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def module_names(module: str) -> frozenset[str]:
    """Names bound at the top level of `module` (under `if` and `try` too)."""
    names: set[str] = set()
    pending = list(_syntax(module).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            pending += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                        *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return frozenset(names)


@functools.cache
def class_index() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Class name -> (module, definition) of every Undertow class of that name."""
    index: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for module in _sources():
        for node in ast.walk(_syntax(module)):
            if isinstance(node, ast.ClassDef):
                index.setdefault(node.name, []).append((module, node))
    return index


def _self_targets(node: ast.AST) -> set[str]:
    """Attributes of `self` assigned anywhere under `node`."""
    found = set()
    for inner in ast.walk(node):
        targets = (inner.targets if isinstance(inner, ast.Assign)
                   else [inner.target] if isinstance(inner, (ast.AnnAssign, ast.AugAssign))
                   else [])
        found.update(t.attr for target in targets for t in ast.walk(target)
                     if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                     and t.value.id == "self")
    return found


@functools.cache
def members(module: str, name: str) -> frozenset[str]:
    """The methods, class attributes, fields and `self.` attributes of the class `name` of
    `module`, with those of its Undertow bases (outside bases' members are not known)."""
    found: set[str] = set()
    for owner, node in class_index().get(name, []):
        if owner != module:
            continue
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                found.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                found.add(stmt.target.id)
        found |= _self_targets(node)
        for base in node.bases:
            resolved = _resolve(module, ast.unparse(base).partition("[")[0])
            if ":" in resolved:
                found |= members(*resolved.split(":"))
    return frozenset(found)


def classes_named(name: str) -> list[tuple[str, str]]:
    return [(module, name) for module, _ in class_index().get(name, [])]


def field_types(field: str) -> list[tuple[str, str]]:
    """The Undertow classes that an annotated class field named `field` holds (a config
    section, say: `RunSections.loss` holds a `LossConfig`)."""
    found = []
    for classes in class_index().values():
        for module, node in classes:
            for stmt in node.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.target.id == field):
                    for named in re.findall(r"[A-Za-z_][\w.]*", ast.unparse(stmt.annotation)):
                        resolved = _resolve(module, named)
                        if ":" in resolved:
                            found.append(tuple(resolved.split(":")))
    return found


def modules_named(last: str) -> list[str]:
    return [module for module in _sources() if module.rpartition(".")[2] == last]


def _has(owners: list[tuple[str, str]], rest: list[str]) -> bool:
    """Whether one of the classes `owners` has the attribute path `rest`."""
    if not rest:
        return bool(owners)
    return any(rest[0] in members(*owner) for owner in owners) and (
        len(rest) == 1 or _has([c for o in owners for c in classes_named(rest[0])
                                if rest[0] in members(*o)], rest[1:]))


def _in_module(module: str, rest: list[str]) -> bool:
    """Whether `module.rest[0].rest[1]...` names something: a submodule, a top-level name,
    a class's member."""
    if not rest:
        return True
    if f"{module}.{rest[0]}" in _sources():
        return _in_module(f"{module}.{rest[0]}", rest[1:])
    if rest[0] not in module_names(module):
        return False
    return len(rest) == 1 or _has([(module, rest[0])] if (module, rest[0]) in [
        (m, n) for m, n in classes_named(rest[0])] else [], rest[1:])


def names_something(dotted: str) -> bool:
    """Whether a dotted name of the doc names something in the code: `undertow.x.y` a
    module (and what follows, a name in it), `Class.member` a class with that member,
    `module.name` a name at the top of a module of that name, or `section.key` a field of
    the class that a field `section` holds (a config key)."""
    parts = dotted.split(".")
    if parts[0] == "undertow":
        known = [i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in _sources()]
        return bool(known) and _in_module(".".join(parts[:known[0]]), parts[known[0]:])
    if parts[0][0].isupper():
        return _has(classes_named(parts[0]), parts[1:])
    return (any(_in_module(module, parts[1:]) for module in modules_named(parts[0]))
            or _has(field_types(parts[0]), parts[1:]) or _in_standard_library(parts))


def _in_standard_library(parts: list[str]) -> bool:
    """Whether `parts` names something of a standard library module (`typing.Protocol`)."""
    if parts[0] not in sys.stdlib_module_names:
        return False
    found = importlib.import_module(parts[0])
    for part in parts[1:]:
        found = getattr(found, part, None)
    return found is not None


@functools.cache
def ancestors(module: str, name: str) -> frozenset[str]:
    """The bases of a class, and theirs, read with ast: an Undertow class as
    `module:Class`, an outside one by its dotted name."""
    found: set[str] = set()
    for owner, node in class_index().get(name, []):
        if owner == module:
            for base in node.bases:
                resolved = _resolve(module, ast.unparse(base))
                found.add(resolved)
                found |= ancestors(*resolved.split(":")) if ":" in resolved else set()
    return frozenset(found)


@functools.cache
def known_identifiers() -> frozenset[str]:
    """Every identifier the code binds (module names, classes, members, functions,
    parameters), reads as an attribute or writes as a string; builtins, pytest's markers
    and setup.py's names too."""
    known = set(dir(builtins)) | set(module_names_of(REPO / "setup.py"))
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    known |= {m.partition(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    for module in _sources():
        known |= module_names(module)
        for node in ast.walk(_syntax(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                known.add(node.name)
            elif isinstance(node, ast.arg):
                known.add(node.arg)
            elif isinstance(node, ast.Attribute):
                known.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                known.add(node.target.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                known.add(node.value)
    return frozenset(known)


def module_names_of(path: Path) -> set[str]:
    """The names a Python file outside the packages binds at its top level."""
    return {target.id for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Name)}


def public_names(module: str) -> list[str]:
    """The names in a module's `__all__`, read with ast (none for no module)."""
    for node in _syntax(module).body if module else []:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            return list(ast.literal_eval(node.value))
    return []
