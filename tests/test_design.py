"""docs/design.md checked against the code, as `tests/test_readme.py` checks the README's
commands (the checks: `tests/design_checks.py`, reading the code with `ast` through
`tests/code_index.py`); then each check fed a text it must refuse."""

import ast
from pathlib import Path

import pytest

from tests.code_index import members, names_something
from tests.design_checks import (
    docstring_breaks,
    docstring_members,
    drawing_breaks,
    drawn_tree,
    error_table_breaks,
    layout_breaks,
    marker_breaks,
    name_breaks,
    never_imports,
    path_breaks,
    placement_breaks,
    section,
)

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


# The tests: design.md as it is, then each check on a text it must refuse.

@pytest.fixture(scope="module")
def design() -> str:
    return DESIGN.read_text()


@pytest.mark.parametrize("check", [error_table_breaks, marker_breaks, layout_breaks,
                                   path_breaks, name_breaks, placement_breaks,
                                   docstring_breaks],
                         ids=lambda check: check.__name__)
def test_design_md_agrees_with_the_code(design, check):
    breaks = check(design)
    assert not breaks, "docs/design.md drifted from the code; fix the one that is wrong:\n" \
        + "\n".join(breaks)


def _with_row(text: str, heading: str, row: str) -> str:
    """`text` with `row` added to the table of section `heading`."""
    body = section(text, heading)
    last = [line for line in body.splitlines() if line.startswith("|")][-1]
    return text.replace(last, f"{last}\n{row}", 1)


def test_error_check_refuses_a_root_under_the_wrong_base(design):
    wrong = _with_row(design, "Errors", "| `gateway/` | `GatewayError` | `TreeError` |")
    assert "TreeError is not under GatewayError, as the row of gateway/ says" in \
        error_table_breaks(wrong)
    wrong = _with_row(design, "Errors", "| `gateway/trees/` | `TreeError(GatewayError)` | |")
    assert "TreeError's bases are ['ValueError'], not ['GatewayError']" in \
        error_table_breaks(wrong)
    wrong = _with_row(design, "Errors", "| `adapters/` | `AdapterError` | `adapters/base.py` |")
    assert "AdapterError is not drawn in adapters/base.py: the row of adapters/ names " \
        "adapters/errors.py, whose docstring draws it" in error_table_breaks(wrong)


def test_drawing_check_refuses_a_class_under_the_wrong_parent():
    doc = ("The tree.\n\n    GatewayError        500\n    ├── PoolError\n    │   └── PoolBusy"
           "\n    └── TreeError   (no)\n        └── Nowhere\n")
    assert drawn_tree(doc) == [("GatewayError", None), ("PoolError", "GatewayError"),
                               ("PoolBusy", "PoolError"), ("TreeError", "GatewayError"),
                               ("Nowhere", "TreeError")]
    assert drawing_breaks(doc) == ["TreeError is drawn under GatewayError, and is not under it",
                                   "Nowhere is drawn, and is no class of the code"]


def test_marker_check_refuses_a_missing_marker():
    assert marker_breaks("Markers: `docker`, `gpu`, `nightly`.") [-1:] == [
        "marker nightly is in docs/design.md, not in pyproject.toml"]
    assert "marker slow is in pyproject.toml, not in docs/design.md" in \
        marker_breaks("Markers: `docker`, `gpu`.")


def test_layout_check_refuses_a_wrong_edge_and_name(design):
    wrong = _with_row(design, "Layout", "| `sandboxes/` | `undertow.sandbox` | | `torch` |")
    breaks = layout_breaks(wrong)
    assert "sandboxes/ imports as undertow.sandboxes, not ['undertow.sandbox']" in breaks
    assert any(b.startswith("sandboxes/ never imports {'package': ({'torch'}") for b in breaks)
    assert never_imports("`undertow.a`, `undertow.b` but `undertow.b.c`; at its root, "
                          "`undertow.d`") == {"package": ({"undertow.a", "undertow.b"},
                                                          {"undertow.b.c"}),
                                              "root": ({"undertow.d"}, set())}


def test_path_and_name_checks_refuse_what_is_gone():
    text = ("1. `learner/loop.py` runs `RunLoop.run`, and `train_run.OneCell`; `api/` and "
            "`pool.py`.\n\n| `gateway/front/` | `api/` | `calls.py` | `SGLangClientManager` |\n")
    assert [b.split(" (")[0] for b in path_breaks(text)] == [
        "learner/loop.py does not exist", "api/ does not exist", "pool.py does not exist"]
    assert name_breaks(text + "`COMMAND_TABLE` and `pack_step`") == [
        "train_run.OneCell names nothing in the code",
        "SGLangClientManager is no class of the code", "COMMAND_TABLE is no name of the code"]
    assert placement_breaks("`PolicyModel.score` (`learner/train.py`); `learner/model.py` "
                            "(`PolicyModel`)") == [
        "PolicyModel is defined in learner/model.py, not in learner/train.py"]
    assert names_something("loss.sequence_mask") and names_something("Learner.train_step")
    assert not names_something("Learner.run")


def test_docstring_check_refuses_a_method_the_class_lost():
    node = ast.parse('class Learner:\n    """The policy; `run` is the loop; `save()`."""\n').body[0]
    assert isinstance(node, ast.ClassDef) and docstring_members(node) == {"run", "save"}
    assert "run" not in members("undertow.learner.train", "Learner")
    assert "save" in members("undertow.learner.train", "Learner")
