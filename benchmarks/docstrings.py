"""How much of each package is prose, and how much of its public surface is typed.

    python -m benchmarks.docstrings [PACKAGE_FOLDER ...]   (default: the five packages)

A static count (ast, no imports), printed as a Markdown table, one row per package and a
total; issue 39 compares `doc_per_100_code` with mini-swe-agent's 8. A docstring line is a
line of a module, class or function docstring; a code line is any other line that is not
blank and not only a comment. `module_doc_over_20` counts module docstrings over 20 lines.
`untyped_share` is the share of the parameters of public functions (no leading underscore,
not nested in a function; `self`/`cls` left out) that are unannotated or annotated `Any`.
Folders named `tasks` under sandboxes/ are task repositories, not Undertow code: left out.
"""

import argparse
import ast
import json
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGES = ("gateway", "learner", "adapters", "sandboxes", "undertow")
SKIPPED_PARTS = ("tasks", "__pycache__")


@dataclass
class Counts:
    num_files: int = 0
    code_lines: int = 0
    doc_lines: int = 0
    module_doc_lines: int = 0
    module_doc_over_20: int = 0
    num_params: int = 0
    num_untyped_params: int = 0

    def add(self, other: "Counts") -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def row(self, name: str) -> dict[str, object]:
        return {
            "package": name, **asdict(self),
            "doc_per_100_code": round(100 * self.doc_lines / max(self.code_lines, 1), 1),
            "untyped_share": round(self.num_untyped_params / max(self.num_params, 1), 3),
        }


def docstring_lines(tree: ast.Module) -> tuple[set[int], int]:
    """Line numbers (1-based) of every docstring, and the module docstring's line count."""
    lines: set[int] = set()
    module_lines = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        first, last = body[0].lineno, body[0].end_lineno or body[0].lineno
        lines.update(range(first, last + 1))
        if isinstance(node, ast.Module):
            module_lines = last - first + 1
    return lines, module_lines


def is_untyped(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return True
    return (isinstance(annotation, ast.Name) and annotation.id == "Any") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "Any")


def public_functions(tree: ast.Module):
    """Functions at module level and methods of module-level classes, public names only."""
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        if isinstance(node, ast.ClassDef) and node.name.startswith("_"):
            continue
        for member in members:
            if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef) and (
                    not member.name.startswith("_") or member.name == "__init__"):
                yield member, isinstance(node, ast.ClassDef)


def count_params(tree: ast.Module) -> tuple[int, int]:
    num_params = num_untyped = 0
    for function, is_method in public_functions(tree):
        args = function.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        params += [arg for arg in (args.vararg, args.kwarg) if arg is not None]
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod"
                     for d in function.decorator_list)
        if is_method and not static and params and params[0].arg in ("self", "cls"):
            params = params[1:]
        num_params += len(params)
        num_untyped += sum(is_untyped(param.annotation) for param in params)
    return num_params, num_untyped


def count_file(path: Path) -> Counts:
    source = path.read_text()
    tree = ast.parse(source)
    doc, module_doc = docstring_lines(tree)
    code = sum(1 for number, line in enumerate(source.splitlines(), 1)
               if number not in doc and line.strip() and not line.strip().startswith("#"))
    num_params, num_untyped = count_params(tree)
    return Counts(num_files=1, code_lines=code, doc_lines=len(doc), module_doc_lines=module_doc,
                  module_doc_over_20=int(module_doc > 20), num_params=num_params,
                  num_untyped_params=num_untyped)


def count_package(folder: Path) -> Counts:
    total = Counts()
    for path in sorted(folder.rglob("*.py")):
        if any(part in SKIPPED_PARTS for part in path.relative_to(folder).parts[:-1]):
            continue
        total.add(count_file(path))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=list(PACKAGES))
    parser.add_argument("--json", action="store_true", help="print JSON rows, not a table")
    args = parser.parse_args()
    rows, total = [], Counts()
    for folder in args.folders:
        counts = count_package(Path(folder))
        total.add(counts)
        rows.append(counts.row(folder))
    rows.append(total.row("total"))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key in keys) + " |")


if __name__ == "__main__":
    main()
