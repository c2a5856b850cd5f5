"""The import edges of docs/design.md ("Layout"), checked in fresh processes; no import cycle
among modules; one exception root per package, drawn in its `errors.py`.

Each module is imported in a process of its own, forked from one probe process per package
(a fresh interpreter per module cost a minute, most of it torch's import in each learner
module, gateway modules aiohttp). The probe has imported no Undertow module, only the outside
packages the package's modules import at module level, so that each fork does not pay for
them again."""

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.import_graph import imported_modules, runtime_nodes, strong_components

# Argument: JSON {"preload", "forbidden", "modules"}. Prints JSON {module: the torch and
# Undertow modules importing it loads, or {"error": its traceback}}. Fork, not a fresh
# interpreter, so that the preloaded (outside) modules are paid for once.
PROBE = """
import importlib, json, os, sys, traceback
request = json.loads(sys.argv[1])
for name in request["preload"]:
    try:
        importlib.import_module(name)
    except ImportError:
        pass   # a name that is no module; or a missing one, which fails its importer's fork
    loaded = [m for m in sys.modules for p in ['undertow', *request["forbidden"]]
              if m == p or m.startswith(p + '.')]
    assert not loaded, f'importing {name} loads {loaded[:3]}'


def probe(module):
    try:
        importlib.import_module(module)
    except BaseException:
        return {'error': traceback.format_exc()}
    return sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'undertow'))


found = {}
for module in request["modules"]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        with os.fdopen(write_end, 'w') as out:
            json.dump(probe(module), out)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as reply:
        found[module] = json.loads(reply.read())
    os.waitpid(pid, 0)
print(json.dumps(found))
"""

# package -> module prefixes it must never import
FORBIDDEN = {
    "undertow.gateway": ["torch", "undertow.learner", "undertow.sandboxes", "undertow.adapters"],
    "undertow.sandboxes": ["torch", "undertow.gateway", "undertow.learner", "undertow.adapters"],
    "undertow.adapters": ["torch", "undertow.learner"],
    "undertow.learner": ["undertow.sandboxes", "undertow.adapters"],
}


def _all_modules(package: str) -> list[str]:
    import pkgutil

    root = __import__(package, fromlist=["_"])
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
        names.append(info.name)
    return names


def _preload(package: str) -> list[str]:
    """The outside packages that the package's modules import at module level: the probe
    imports them once, before it forks, so that each fork pays only for Undertow's own
    code. One that loads a module the package must not import (torch, say) fails the
    probe, as the import of the module that names it would have failed the test."""
    named = set()
    for module in _all_modules(package):
        if module.startswith(TORCH_ALLOWED) or module not in _sources():
            continue   # never probed: the built-in engine's torch modules
        for node in _syntax(module).body:
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                named.add(node.module)   # and each name, in case it is a module
                named.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(n for n in named if n.partition(".")[0] not in ("undertow", "__future__"))


@functools.cache
def _imported_by_package(package: str) -> dict[str, list[str]]:
    """Module of `package` -> the torch and Undertow modules importing it loads, each
    imported in a process of its own (forked from one probe process)."""
    modules = [m for m in _all_modules(package) if not m.startswith(TORCH_ALLOWED)]
    request = json.dumps({"preload": _preload(package), "forbidden": FORBIDDEN[package],
                          "modules": modules})
    out = subprocess.run([sys.executable, "-c", PROBE, request],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _imported_by(module: str) -> list[str]:
    """Modules imported by importing `module` in a process of its own."""
    package = next(p for p in sorted(FORBIDDEN) if module == p or module.startswith(p + "."))
    imported = _imported_by_package(package)[module]
    assert not isinstance(imported, dict), f"importing {module} failed:\n{imported['error']}"
    return imported


# Only the built-in engine's torch modules may import torch inside the gateway.
TORCH_ALLOWED = ("undertow.gateway.builtin_engine.",)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_import_edges(package):
    for module in _all_modules(package):
        if module.startswith(TORCH_ALLOWED) or "__main__" in module:
            continue
        imported = _imported_by(module)
        for prefix in FORBIDDEN[package]:
            if package == "undertow.learner" and prefix == "undertow.gateway":
                continue
            bad = [m for m in imported if m == prefix or m.startswith(prefix + ".")]
            assert not bad, f"{module} imports {bad[:3]}, which docs/design.md forbids"


def test_learner_uses_only_the_gateway_tree_model():
    """The learner, imported, loads no gateway module outside `undertow.gateway.trees`."""
    for module in _all_modules("undertow.learner"):
        gateway = [m for m in _imported_by(module) if m.startswith("undertow.gateway.")
                   and not m.startswith("undertow.gateway.trees")]
        assert not gateway, f"{module} imports gateway internals {gateway[:3]}"


@pytest.mark.parametrize("package", ["undertow.gateway", "undertow.sandboxes",
                                     "undertow.adapters"])
def test_package_root_does_not_import_torch(package):
    assert not [m for m in _imported_by(package) if m.split(".")[0] == "torch"]


# Below: the import graph and the exception classes, read from every module's source
# (no import), so function-level imports count and a cycle is found even where Python's
# import order happens to hide it. Imports under `if TYPE_CHECKING:` never run: left out.

PACKAGES = ("undertow.gateway.trees", "undertow.gateway", "undertow.cells",
            "undertow.adapters", "undertow.learner", "undertow.sandboxes")


@functools.cache
def _sources() -> dict[str, Path]:
    """Every Undertow module (dotted name) -> its file. A folder without `__init__.py`
    (the bundled task repositories under sandboxes/tasks) holds no Undertow module."""
    import importlib.util

    roots = {package: Path(importlib.util.find_spec(package).submodule_search_locations[0])
             for package in ("undertow", *PACKAGES)}   # found, not imported
    found = {}
    for prefix, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if not all((root / Path(*parts[:i]) / "__init__.py").exists()
                       for i in range(len(parts))):
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((prefix, *parts))] = path
    return found


@functools.cache
def _syntax(module: str) -> ast.Module:
    return ast.parse(_sources()[module].read_text(encoding="utf-8"))


def _runtime_nodes(module: str) -> list[ast.AST]:
    return runtime_nodes(_syntax(module))


def _from_target(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name of a `from ... import` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    package = module if _sources()[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports(module: str) -> set[str]:
    """Undertow modules `module` imports, at any level (module, class or function)."""
    sources = _sources()
    return imported_modules(module, sources[module].name == "__init__.py", _syntax(module),
                            set(sources))


def test_cycle_finder_reports_each_cycle_with_its_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(strong_components(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_no_import_cycle_among_modules():
    graph = {module: _imports(module) for module in _sources()}
    assert "undertow.cells.backends" in graph["undertow.run.train"]   # imported in a function
    cycles = [" -> ".join(component) + "  (" + "; ".join(
        f"{m} imports {sorted(graph[m] & set(component))}" for m in component) + ")"
        for component in strong_components(graph)]
    assert not cycles, "import cycles; move the shared piece lower down:\n" + "\n".join(cycles)


def _bindings(module: str) -> dict[str, str]:
    """Module-level names bound by imports -> what they name, as a dotted path."""
    bound = {}
    for node in _syntax(module).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.partition(".")[0]] = \
                    alias.name if alias.asname else alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(module, node)
            bound.update({alias.asname or alias.name: f"{target}.{alias.name}"
                          for alias in node.names})
    return bound


@functools.cache
def _classes(module: str) -> dict[str, tuple[str, ...]]:
    """The module's classes (at any depth) -> their bases, as written."""
    return {node.name: tuple(ast.unparse(base) for base in node.bases)
            for node in _runtime_nodes(module) if isinstance(node, ast.ClassDef)}


def _resolve(module: str, dotted: str, depth: int = 0) -> str:
    """`dotted` as written in `module`, as `undertow.x.y:Class` for an Undertow class, or
    the dotted name of an outside one (builtins have no dots). Re-exports are followed."""
    first, _, rest = dotted.partition(".")
    if not rest and first in _classes(module):
        return f"{module}:{first}"
    if first not in _bindings(module) or depth > 20:
        return dotted
    path = _bindings(module)[first] + ("." + rest if rest else "")
    owner, _, name = path.rpartition(".")
    if owner in _sources() and path not in _sources():
        return _resolve(owner, name, depth + 1)
    return path


def _is_outside_exception(dotted: str) -> bool:
    """Whether an outside class is an exception; a module is imported only for a name
    that reads as one (not for `torch.nn.Module`, so that no test process pays torch)."""
    import builtins
    import importlib

    owner, _, name = dotted.rpartition(".")
    if owner and not name.endswith(("Error", "Exception", "Exit", "Interrupt", "Warning")):
        return False
    try:
        found = getattr(importlib.import_module(owner) if owner else builtins, name)
    except (ImportError, AttributeError):
        return False
    return isinstance(found, type) and issubclass(found, BaseException)


@functools.cache
def _exception_bases(qualified: str) -> tuple[str, ...] | None:
    """The resolved bases of an Undertow class, if it is an exception, else None."""
    module, _, name = qualified.partition(":")
    bases = tuple(_resolve(module, base) for base in _classes(module).get(name, ()))
    is_exception = any(_exception_bases(base) is not None if ":" in base
                       else _is_outside_exception(base) for base in bases)
    return bases if is_exception else None


def _package_of(module: str) -> str:
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")),
                "undertow")


def _exception_roots() -> dict[str, list[str]]:
    """package -> its exception classes that subclass no exception of the package."""
    roots: dict[str, list[str]] = {}
    for module in _sources():
        for name in _classes(module):
            bases = _exception_bases(f"{module}:{name}")
            if bases is None:
                continue
            inside = [b for b in bases if ":" in b and _package_of(b) == _package_of(module)
                      and _exception_bases(b) is not None]
            if not inside:
                roots.setdefault(_package_of(module), []).append(f"{module}:{name}")
    return roots


def test_exception_roots_are_found_through_imports_and_re_exports():
    roots = _exception_roots()
    assert _exception_bases("undertow.gateway.errors:BadRequest") == (
        "undertow.gateway.errors:GatewayError",)
    assert _exception_bases("undertow.learner.train:Learner") is None
    assert "undertow.sandboxes.errors:SandboxError" in roots["undertow.sandboxes"]


@pytest.mark.parametrize("package", ["undertow", *PACKAGES])
def test_one_exception_root_per_package_in_its_errors_module(package):
    roots = _exception_roots().get(package, [])
    assert len(roots) == 1 and roots[0].startswith(f"{package}.errors:"), (
        f"{package} has exception roots {roots}; it should have one, in {package}.errors, "
        "and every other exception of the package under it")


# importer -> (the gateway modules it must never import, at any level, as `_imports` reads
# them; the ones of those it may). The gateway's root modules are those the three share.
ENGINE_SIDE = ("undertow.gateway.engines", "undertow.gateway.engine_pool",
               "undertow.gateway.builtin_engine")
GATEWAY_EDGES = {
    "undertow.learner": (("undertow.gateway",), ("undertow.gateway.trees",)),
    "undertow.gateway.trees": (("undertow.gateway",), ("undertow.gateway.trees",)),
    # the built-in engine is a server of its own: beside the drivers, as SGLang is
    "undertow.gateway.builtin_engine": (("undertow.gateway.front", *ENGINE_SIDE),
                                        ("undertow.gateway.builtin_engine",)),
    "undertow.gateway.engine_pool": (("undertow.gateway.front",
                                      "undertow.gateway.builtin_engine"), ()),
    "undertow.gateway.engines": (("undertow.gateway.front", "undertow.gateway.engine_pool",
                                  "undertow.gateway.builtin_engine"), ()),
    "undertow.gateway": (("undertow.gateway.front", *ENGINE_SIDE), ()),
}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _gateway_edge_breaks(graph: dict[str, set[str]]) -> list[str]:
    """The imports in `graph` that GATEWAY_EDGES forbids, as "a imports b"."""
    breaks = []
    for module, imported in sorted(graph.items()):
        importer = next((p for p in GATEWAY_EDGES if _within(module, p)), None)
        if importer == "undertow.gateway" and module.count(".") > 2:
            continue   # the front (a subpackage not listed), which may import all of it
        if importer is None:
            continue
        forbidden, allowed = GATEWAY_EDGES[importer]
        breaks += [f"{module} imports {target}" for target in sorted(imported)
                   if target != "undertow.gateway"
                   and any(_within(target, p) for p in forbidden)
                   and not any(_within(target, p) for p in allowed)]
    return breaks


def test_gateway_edge_check_finds_each_kind_of_break():
    graph = {"undertow.learner.train": {"undertow.gateway.trees.tree",
                                        "undertow.gateway.errors"},
             "undertow.gateway.trees.tree": {"undertow.gateway.trees.errors",
                                             "undertow.gateway.metrics"},
             "undertow.gateway.engine_pool.pool": {"undertow.gateway.front.store",
                                                   "undertow.gateway.errors"},
             "undertow.gateway.render": {"undertow.gateway.engines.protocol",
                                         "undertow.gateway.trees.template_env"},
             "undertow.gateway.front.app": {"undertow.gateway.engine_pool.pool",
                                            "undertow.gateway.render"}}
    assert _gateway_edge_breaks(graph) == [
        "undertow.gateway.engine_pool.pool imports undertow.gateway.front.store",
        "undertow.gateway.render imports undertow.gateway.engines.protocol",
        "undertow.gateway.trees.tree imports undertow.gateway.metrics",
        "undertow.learner.train imports undertow.gateway.errors"]


def test_gateway_packages_import_only_downwards():
    """front -> engine pool -> engine drivers -> the gateway's root -> trees; the built-in
    engine beside the drivers; the learner -> trees alone."""
    graph = {module: _imports(module) for module in _sources()}
    assert "undertow.gateway.trees.tree" in graph["undertow.learner.packing"]
    assert "undertow.gateway.engine_pool.pool" in graph["undertow.gateway.front.app"]
    breaks = _gateway_edge_breaks(graph)
    assert not breaks, "imports docs/design.md (\"Layout\") forbids:\n" + "\n".join(breaks)
