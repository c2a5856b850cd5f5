"""The import graph of a checkout, read from its sources (no import), and its sizes.

`undertow.X` is mapped to its folder (`FOLDERS`); a module's imports count at any level
(module, class or function), less `if TYPE_CHECKING:` blocks. A package is a folder with
`__init__.py` (and all folders above it); a package edge is a module of one importing a
module of another. Cycles: strongly connected components of more than one module (or
package). Sizes are ast counts: a file's lines, a function's lines from `def` to its last
line (methods and nested functions included). Used by `benchmarks/walks.py`.
"""

import ast
from pathlib import Path

FOLDERS = {"undertow": "undertow", "undertow.gateway": "gateway",
           "undertow.adapters": "adapters", "undertow.learner": "learner",
           "undertow.sandboxes": "sandboxes"}
LONG_FUNCTION_LINES = 60
LONG_FILE_LINES = 400


def module_files(tree: Path) -> dict[str, Path]:
    """Every Undertow module of the checkout `tree` (dotted name) -> its file. A folder
    without `__init__.py` (the bundled task repositories) holds no Undertow module."""
    found = {}
    for prefix, folder in FOLDERS.items():
        root = tree / folder
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if not all((root / Path(*parts[:i]) / "__init__.py").is_file()
                       for i in range(len(parts))):
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((prefix, *parts))] = path
    return found


def runtime_nodes(syntax: ast.Module) -> list[ast.AST]:
    """The module's nodes, less the bodies of `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(syntax):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return [node for node in ast.walk(syntax) if id(node) not in skipped]


def imported_modules(module: str, is_package: bool, syntax: ast.Module,
                     modules: set[str]) -> set[str]:
    """The Undertow modules `module` imports, at any level."""
    imported: set[str] = set()
    for node in runtime_nodes(syntax):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{target}" if target else base
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:
                    imported.add(f"{target}.{alias.name}")
                elif target in modules:
                    imported.add(target)
    imported.discard(module)
    return imported


def strong_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Kosaraju, iterative)."""
    order: list[str] = []
    seen: set[str] = set()
    for start in sorted(graph):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            node, successors = stack[-1]
            successor = next(successors, None)
            if successor is None:
                stack.pop()
                order.append(node)
            elif successor not in seen:
                seen.add(successor)
                stack.append((successor, iter(sorted(graph.get(successor, ())))))
    reverse: dict[str, set[str]] = {node: set() for node in graph}
    for node, successors in graph.items():
        for successor in successors:
            reverse.setdefault(successor, set()).add(node)
    components, assigned = [], set()
    for start in reversed(order):
        if start in assigned:
            continue
        component, pending = [], [start]
        assigned.add(start)
        while pending:
            node = pending.pop()
            component.append(node)
            for predecessor in reverse[node] - assigned:
                assigned.add(predecessor)
                pending.append(predecessor)
        if len(component) > 1:
            components.append(sorted(component))
    return sorted(components)


def package_of(module: str, files: dict[str, Path]) -> str:
    return module if files[module].name == "__init__.py" else module.rpartition(".")[0]


def function_sizes(syntax: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method, nested ones included."""
    sizes = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    sizes.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(syntax, "")
    return sizes


def import_graph(tree: Path) -> dict:
    """Modules and packages, the package edges, cycles and sizes of the checkout `tree`."""
    files = module_files(tree)
    syntax = {module: ast.parse(path.read_text(encoding="utf-8"))
              for module, path in files.items()}
    graph = {module: imported_modules(module, files[module].name == "__init__.py",
                                      syntax[module], set(files)) for module in files}
    packages: dict[str, set[str]] = {}
    for module in files:
        packages.setdefault(package_of(module, files), set())
    for module, targets in graph.items():
        source = package_of(module, files)
        packages[source] |= {package_of(t, files) for t in targets} - {source}
    lines = {module: len(path.read_text(encoding="utf-8").splitlines())
             for module, path in files.items()}
    functions = sorted(((f"{module}.{name}", size) for module in files
                        for name, size in function_sizes(syntax[module])),
                       key=lambda item: (-item[1], item[0]))
    return {
        "num_modules": len(files), "num_packages": len(packages),
        "modules_per_package": {p: sum(package_of(m, files) == p for m in files)
                                for p in sorted(packages)},
        "package_edges": {p: sorted(targets) for p, targets in sorted(packages.items())},
        "num_package_edges": sum(len(targets) for targets in packages.values()),
        "module_cycles": strong_components(graph),
        "package_cycles": strong_components(packages),
        "num_lines": sum(lines.values()),
        "files_over_400_lines": [[m, n] for m, n in sorted(lines.items(), key=lambda i: -i[1])
                                 if n > LONG_FILE_LINES],
        "num_functions": len(functions),
        "functions_over_60_lines": [[name, size] for name, size in functions
                                    if size > LONG_FUNCTION_LINES],
    }
