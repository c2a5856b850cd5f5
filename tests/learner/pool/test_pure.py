"""`learner/pool/` is the pool's pure decision code: the simulator runs it with no torch,
no processes and no Ray, so it must import nothing of the runtime (`learner/elastic/`)."""

import ast
from pathlib import Path

import undertow.learner.pool

ALLOWED = ("undertow.learner.pool", "undertow.learner.errors")
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
    folder = Path(undertow.learner.pool.__file__).parent
    files = sorted(folder.glob("*.py"))
    assert len(files) >= 5
    foreign = {f"{path.name}: {name}" for path in files for name in imported_modules(path)
               if not name.startswith(ALLOWED) and name.split(".")[0] not in STDLIB}
    assert foreign == set()
