"""The checks of docs/design.md against the code that `tests/test_design.py` runs: its
exception roots ("Errors") and the hierarchies drawn in the `errors.py` it names, its test
markers, its layout table ("Layout"), every repository path, class, dotted name and
identifier it names in backticks, and the docstrings of the classes it names where they
name a member of their own class. Each check takes the document's text and returns what it
found wrong, so that a test can feed it a broken text."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import tomllib
from pathlib import Path

from tests.code_index import (
    REPO,
    ancestors,
    class_index,
    classes_named,
    known_identifiers,
    members,
    names_something,
    public_names,
)
from tests.test_layering import FORBIDDEN, GATEWAY_EDGES, PACKAGES, _sources

TICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
PATH = re.compile(r"[\w.-]+(/[\w.-]+)*/?")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".toml", ".json", ".jsonl", ".txt", ".cfg")


# The text: sections, blocks (a paragraph, a list item or a table row) and tables.

def section(text: str, heading: str) -> str:
    """The body of the `## heading` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/design.md has no section '## {heading}'"
    return match.group(1)


def blocks(text: str) -> list[str]:
    """The text's paragraphs, list items and table rows, fenced code left out."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    found: list[str] = []
    for paragraph in re.split(r"\n\s*\n", prose):
        for piece in re.split(r"\n(?=\s*(?:\d+\.|-) |\|)", paragraph):
            if piece.strip():
                found.append(piece)
    return found


def table(body: str) -> list[list[str]]:
    """The cells of the first Markdown table in `body`, header and rule left out."""
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows[2:]]


def ticked(text: str) -> list[str]:
    return TICKED.findall(text)


# The checks: each returns what it found wrong.

def error_table_breaks(text: str) -> list[str]:
    """"Errors": each row's root is an exception of its folder's `errors.py`, drawn in its
    docstring, whose bases are those the doc writes in parentheses (`TreeError(ValueError)`;
    none: `Exception`); every exception that `errors.py` defines is under that root, and so
    is every other class the row names; every package with a root of its own has a row."""
    breaks, rows = [], set()
    for row in table(section(text, "Errors")):
        folder = (ticked(row[0]) or [row[0]])[0].rstrip("/") + "/"
        if not (REPO / folder / "errors.py").is_file() or not ticked(row[1]):
            breaks.append(f"row {row[:2]} names no folder with an errors.py and its root")
            continue
        rows.add(import_name(folder))
        breaks += _error_row_breaks(folder, row)
    return breaks + [f"{package} has an exception root of its own (tests/test_layering.py), "
                     "and no row" for package in ("undertow", *PACKAGES) if package not in rows]


def _error_row_breaks(folder: str, row: list[str]) -> list[str]:
    module = importlib.import_module(import_name(folder) + ".errors")
    root_name, _, bases_text = ticked(row[1])[0].partition("(")
    root = getattr(module, root_name, None)
    if not (isinstance(root, type) and issubclass(root, BaseException)):
        return [f"{folder}errors.py defines no exception {root_name}"]
    breaks = []
    drawn_in = (ticked(row[2]) or [""])[0] if len(row) > 2 else ""
    if drawn_in != f"{folder}errors.py" or root_name not in (module.__doc__ or ""):
        breaks.append(f"{root_name} is not drawn in {drawn_in or 'no module'}: the row of "
                      f"{folder} names {folder}errors.py, whose docstring draws it")
    breaks += drawing_breaks(module.__doc__ or "")
    bases = re.findall(r"\w+", bases_text) or ["Exception"]
    if [base.__name__ for base in root.__bases__] != bases:
        breaks.append(f"{root_name}'s bases are {[b.__name__ for b in root.__bases__]}, "
                      f"not {bases}")
    defined = [v for v in vars(module).values() if isinstance(v, type)
               and issubclass(v, BaseException) and v.__module__ == module.__name__]
    breaks += [f"{error.__name__} of {folder}errors.py is not under {root_name}"
               for error in defined if not issubclass(error, root)]
    named = {n for cell in row[1:] for n in ticked(cell) if re.fullmatch(r"[A-Z]\w*", n)}
    for name in sorted(named - {root_name}):
        if not classes_named(name):
            breaks.append(f"{name}, in the row of {folder}, is no class of the code")
        elif not any(f"{module.__name__}:{root_name}" in ancestors(*found)
                     for found in classes_named(name)):
            breaks.append(f"{name} is not under {root_name}, as the row of {folder} says")
    return breaks


def drawn_tree(doc: str) -> list[tuple[str, str | None]]:
    """The (class, drawn parent) pairs of a hierarchy drawn in a docstring: a root at the
    left of its line, children under `├── ` and `└── `, four columns a level."""
    drawn: list[tuple[str, str | None]] = []
    path: list[str] = []
    indent = 0
    for line in doc.splitlines():
        child = re.match(r"([│ ]*)[├└]── ([A-Z]\w*)", line)
        root = re.match(r"(\s*)([A-Z]\w*(?:Error|Exception))(?:\s{2,}|$)", line)
        if child and path:
            depth = (len(child.group(1)) - indent) // 4 + 1
            path = path[:depth] + [child.group(2)]
            drawn.append((child.group(2), path[depth - 1]))
        elif root:
            indent, path = len(root.group(1)), [root.group(2)]
            drawn.append((root.group(2), None))
    return drawn


def drawing_breaks(doc: str) -> list[str]:
    """Every class a docstring draws exists, under the parent it is drawn under."""
    breaks = []
    for name, parent in drawn_tree(doc):
        found = classes_named(name)
        if not found:
            breaks.append(f"{name} is drawn, and is no class of the code")
        elif parent and not any(base.rpartition(":")[2].rpartition(".")[2] == parent
                                for owner in found for base in ancestors(*owner)):
            breaks.append(f"{name} is drawn under {parent}, and is not under it")
    return breaks


def import_name(folder: str) -> str:
    """The import name of a folder, by setup.py's `FOLDERS` (its `package-dir` mapping),
    read with ast: `gateway/trees/` -> `undertow.gateway.trees`."""
    tree = ast.parse((REPO / "setup.py").read_text())
    folders = next(ast.literal_eval(node.value) for node in tree.body
                   if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "FOLDERS")
    parts = folder.strip("/").split("/")
    name = next(name for name, top in folders.items() if top == parts[0])
    return ".".join([name, *parts[1:]])


def marker_breaks(text: str) -> list[str]:
    """The markers the doc lists (a sentence `Markers, ...: ...`) against pyproject.toml's."""
    listed = re.search(r"Markers[^:`]*:(.*?)\.(?:\s|$)", text, re.S)
    assert listed, "docs/design.md lists no test markers (a sentence 'Markers: ...')"
    documented = set(ticked(listed.group(1)))
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = {m.partition(":")[0].strip()
                for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    return ([f"marker {m} is in pyproject.toml, not in docs/design.md"
             for m in sorted(declared - documented)]
            + [f"marker {m} is in docs/design.md, not in pyproject.toml"
               for m in sorted(documented - declared)])


def never_imports(cell: str) -> dict[str, tuple[set[str], set[str]]]:
    """A "never imports" cell as {"package" or "root": (forbidden, allowed)}: clauses split
    by `;`, one that starts "at its root" for the package's root modules; in a clause, the
    modules after "but" are allowed. Only module names count (`torch`, `undertow...`)."""
    rules: dict[str, tuple[set[str], set[str]]] = {}
    for clause in cell.split(";"):
        scope = "root" if clause.strip().startswith("at its root") else "package"
        forbidden_text, _, allowed_text = clause.partition(" but ")
        forbidden, allowed = rules.setdefault(scope, (set(), set()))
        forbidden.update(_modules_in(forbidden_text))
        allowed.update(_modules_in(allowed_text))
    return {scope: rule for scope, rule in rules.items() if rule[0]}


def _modules_in(text: str) -> list[str]:
    return [name for name in ticked(text) if re.fullmatch(r"(torch|undertow)(\.\w+)*", name)]


def _enforced(name: str) -> dict[str, tuple[set[str], set[str]]]:
    """What tests/test_layering.py forbids the package `name`, in `_never_imports`'s form:
    FORBIDDEN for the whole package; GATEWAY_EDGES for it, or, for the gateway, for its
    root modules."""
    rules: dict[str, tuple[set[str], set[str]]] = {}
    forbidden, allowed = GATEWAY_EDGES.get(name, ((), ()))
    scope = "root" if name == "undertow.gateway" else "package"
    if forbidden:   # a package that forbids and allows itself: its own modules, no edge
        rules[scope] = (set(forbidden) - set(allowed), set(allowed) - set(forbidden))
    if name in FORBIDDEN:
        package = rules.setdefault("package", (set(), set()))
        package[0].update(FORBIDDEN[name])
    return rules


def layout_breaks(text: str) -> list[str]:
    """"Layout": each folder is a package, its "imports as" is its import name, its "never
    imports" is what tests/test_layering.py enforces, and every package it enforces an edge
    for has its row."""
    breaks, named = [], set()
    for row in table(section(text, "Layout")):
        folder, imports_as, never = (ticked(row[0]) or [""])[0], ticked(row[1]), row[3]
        if not folder or not (REPO / folder / "__init__.py").is_file():
            breaks.append(f"{folder} is no package (no __init__.py)")
            continue
        name = import_name(folder)
        named.add(name)
        if imports_as != [name]:
            breaks.append(f"{folder} imports as {name}, not {imports_as}")
        if never_imports(never) != _enforced(name):
            breaks.append(f"{folder} never imports {never_imports(never)} by docs/design.md, "
                          f"{_enforced(name)} by tests/test_layering.py")
    breaks += [f"tests/test_layering.py enforces edges of {name}, which Layout has no row for"
               for name in sorted(set(FORBIDDEN) | set(GATEWAY_EDGES)) if name not in named]
    return breaks


def _is_path(token: str) -> bool:
    return (PATH.fullmatch(token) is not None and not token.startswith(".")
            and ("/" in token or token.endswith(".py")))


def path_breaks(text: str) -> list[str]:
    """Every repository path in backticks exists: from the repository's root, or from a
    folder the same block names (a table row's `api/` under its folder `gateway/front/`).
    A path written `name/` is a folder. Templates (`tests/<package>/...`) are left out."""
    breaks = []
    for block in blocks(text):
        paths = [token for token in ticked(block) if _is_path(token)]
        bases = [REPO]
        for token in paths:
            found = REPO / token
            if found.is_dir():
                bases.append(found)
            elif found.is_file():
                bases.append(found.parent)
        for token in paths:
            wanted = Path.is_dir if token.endswith("/") else Path.is_file
            if not any(wanted(base / token) for base in bases):
                breaks.append(f"{token} does not exist (in: {block.strip()[:60]}...)")
    return breaks


def _dotted(token: str) -> str | None:
    """A backticked token as a dotted name: a call's arguments and a config value cut;
    file names are paths, not dotted names."""
    name = re.split(r"[(:]", token)[0].strip()
    if DOTTED.fullmatch(name) and not name.endswith(FILE_SUFFIXES):
        return name
    return None


def name_breaks(text: str) -> list[str]:
    """Every dotted name names something (`names_something`), every bare CamelCase name is
    an Undertow class or a builtin, and every other bare identifier (`pack_step`,
    `COMMAND_GROUPS`, `rid`) is a name the code binds, reads or writes as a string."""
    breaks = []
    for token in dict.fromkeys(ticked(text)):
        dotted, bare = _dotted(token), re.fullmatch(r"([A-Za-z_]\w*)(\(\))?", token)
        if dotted and not names_something(dotted):
            breaks.append(f"{token} names nothing in the code")
        elif (re.fullmatch(r"[A-Z]\w*[a-z]\w*", token) and "_" not in token
              and token not in class_index() and not hasattr(builtins, token)):
            breaks.append(f"{token} is no class of the code")
        elif bare and bare.group(1) not in known_identifiers():
            breaks.append(f"{token} is no name of the code")
    return breaks


CLASS_THEN_PATH = re.compile(r"`([A-Z]\w+)(?:\.\w+)?`,?\s+\(?`([\w/.-]+\.py)`")
PATH_THEN_CLASS = re.compile(r"`([\w/.-]+\.py)`,?\s+\(`([A-Z]\w+)")


def placement_breaks(text: str) -> list[str]:
    """A class written beside a repository path (`RunLoop` (`undertow/cells/loop.py`), or
    `learner/model.py` (`PolicyModel.score`)) is defined in that file, or is in its
    `__all__` (its public import)."""
    pairs = CLASS_THEN_PATH.findall(text) + [(c, p) for p, c in PATH_THEN_CLASS.findall(text)]
    modules = {str(path.relative_to(REPO)): module for module, path in _sources().items()}
    breaks = []
    for name, path in dict.fromkeys(pairs):
        defined_in = [str(_sources()[module].relative_to(REPO))
                      for module, _ in class_index().get(name, [])]
        if ("/" in path and defined_in and path not in defined_in
                and name not in public_names(modules.get(path, ""))):
            breaks.append(f"{name} is defined in {', '.join(defined_in)}, not in {path}")
    return breaks


def named_classes(text: str) -> list[tuple[str, str]]:
    """The Undertow classes the doc names (`Learner`, `Learner.save`, `gateway/...`)."""
    found = []
    for token in dict.fromkeys(ticked(text)):
        first = (_dotted(token) or token).split(".")[0]
        found += classes_named(first) if re.fullmatch(r"[A-Z]\w*", first) else []
    return list(dict.fromkeys(found))


def docstring_members(node: ast.ClassDef) -> set[str]:
    """Members a class docstring names as its own: `Class.name`, `self.name`, `name()`,
    and a backticked bare `name` said to be a method or loop (`run` is the loop)."""
    doc = ast.get_docstring(node) or ""
    named = set(re.findall(rf"\b(?:{node.name}|self)\.(\w+)", doc))
    for token in ticked(doc):
        if re.fullmatch(r"[a-z_]\w*\(\)", token):
            named.add(token[:-2])
    named.update(re.findall(r"`([a-z_]\w*)` (?:is|runs|method|loop)\b", doc))
    return named


def docstring_breaks(text: str) -> list[str]:
    """The docstrings of the classes the doc names name only members they have."""
    breaks = []
    for module, name in named_classes(text):
        for owner, node in class_index()[name]:
            if owner != module:
                continue
            parameters = {arg.arg for method in ast.walk(node) if isinstance(method, (
                ast.FunctionDef, ast.AsyncFunctionDef)) for arg in ast.walk(method.args)
                if isinstance(arg, ast.arg)}
            missing = sorted(docstring_members(node) - members(module, name) - parameters)
            breaks += [f"{module}.{name}'s docstring names {m}, which it has not"
                       for m in missing]
    return breaks
