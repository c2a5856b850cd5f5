"""`python -m benchmarks.docstrings`: prose and typing counts against a hand-counted package."""

from pathlib import Path

from benchmarks.docstrings import count_package

MODULE = '''"""One line.

Two more
lines."""

import os

# a comment, not code


def typed(a: int, b: "str") -> None:
    """A docstring."""
    return None


def untyped(a, b: Any, *args, **kwargs):
    return os.sep


def _private(a, b):
    return a


class Thing:
    """Class doc,
    two lines."""

    def __init__(self, size):
        self.size = size

    def method(self, x: int) -> int:
        return x

    @staticmethod
    def static(x):
        return x
'''


def test_counts_match_a_hand_count(tmp_path: Path) -> None:
    package = tmp_path / "package"
    (package / "tasks").mkdir(parents=True)
    (package / "module.py").write_text(MODULE)
    (package / "tasks" / "ignored.py").write_text('"""A task repository."""\nx = 1\n')
    counts = count_package(package)
    # Docstrings: module 4 lines, `typed` 1, `Thing` 2.
    assert (counts.num_files, counts.doc_lines, counts.module_doc_lines) == (1, 7, 4)
    assert counts.module_doc_over_20 == 0
    # Code: the import, 2 lines each of `typed` (its docstring left out), `untyped` and
    # `_private`, `class`, 2 of `__init__`, 2 of `method`, 3 of `static` (the decorator).
    assert counts.code_lines == 1 + 2 + 2 + 2 + 1 + 2 + 2 + 3
    # Public parameters: typed a, b; untyped a, b, args, kwargs; __init__ size; method x;
    # static x (self left out, _private not public). Untyped: untyped's a, b (Any), args,
    # kwargs; size; static's x.
    assert (counts.num_params, counts.num_untyped_params) == (9, 6)
