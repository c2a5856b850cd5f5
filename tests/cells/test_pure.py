"""The cell pool's decision modules (`undertow/cells/`: `cell`, `config`, `errors`, `policy`,
`state` and the package's `__init__`) are pure: the simulator runs them with no torch, no
processes and no Ray, so they import nothing of the runtime (`undertow/cells/elastic/`, the
loop, the engines)."""

import ast
from pathlib import Path

import undertow.cells

DECISIONS = ("__init__", "cell", "config", "errors", "policy", "state")
ALLOWED = tuple(f"undertow.cells.{name}" for name in DECISIONS[1:]) + ("undertow.learner.errors",)
STDLIB = ("__future__", "dataclasses", "enum", "typing", "collections", "math", "itertools")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_decision_package_imports_only_itself_the_learners_errors_and_the_stdlib():
    folder = Path(undertow.cells.__file__).parent
    files = [folder / f"{name}.py" for name in DECISIONS]
    foreign = {f"{path.name}: {name}" for path in files for name in imported_modules(path)
               if not name.startswith(ALLOWED) and name.split(".")[0] not in STDLIB}
    assert foreign == set()
