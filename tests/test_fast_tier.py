"""`make test-fast`, the edit loop's tier, means what it says: no test it selects needs
Docker, vLLM, an agent program or pretrained weights.

The tier's marker expression is read from the Makefile's `test-fast` recipe, and the suite is
collected with it in a child pytest that loads this module as a plugin (`-p`): its
`pytest_collection_finish` and `pytest_deselected` hooks print, for every test selected or
left out, the fixtures it uses (through other fixtures too), the fixture names among its
parameters (`request.getfixturevalue`) and its markers. A test the tier selects must use
none of `FIXTURE_MARKERS`' fixtures; the tests it leaves out must use every one of them (so
that the report is seen to find them)."""

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIXTURE_MARKERS, fixtures_named

REPO = Path(__file__).resolve().parents[1]
REPORT_PREFIX = "tier-item "
COLLECT_TIMEOUT_S = 300
# What the tier leaves out: every marker of a need it does not meet.
NEEDS = ("docker", "vllm", "agents", "pretrained", "qwen", "gpu", "sglang")


def _report(item, selected: bool, terminal) -> None:
    record = {"id": item.nodeid, "selected": selected, "fixtures": sorted(fixtures_named(item)),
              "markers": sorted({marker.name for marker in item.iter_markers()})}
    terminal.write_line(REPORT_PREFIX + json.dumps(record))


def pytest_deselected(items):
    terminal = items[0].config.pluginmanager.get_plugin("terminalreporter") if items else None
    for item in items:
        _report(item, False, terminal)


def pytest_collection_finish(session):
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    for item in session.items:
        _report(item, True, terminal)


def tier_expression() -> str:
    """The `-m` expression of the Makefile's `test-fast` recipe."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "the Makefile has no test-fast target"
    expression = re.search(r'-m "([^"]+)"', recipe.group(1).replace("\\\n", " "))
    assert expression, f"test-fast selects no markers: {recipe.group(1)}"
    return expression.group(1)


def selects(expression: str, markers: set[str]) -> bool:
    """Whether a test with `markers` matches `expression` (names, and, or, not, brackets)."""
    names = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"}
    return eval(expression, {"__builtins__": {}}, {name: name in markers for name in names})


def test_the_tier_expression_leaves_out_every_need():
    expression = tier_expression()
    assert selects(expression, set())
    for need in NEEDS:
        assert not selects(expression, {need}), (need, expression)


def test_no_test_of_the_tier_uses_a_fixture_it_leaves_out():
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.test_fast_tier",
               "-m", tier_expression()]
    collected = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                               timeout=COLLECT_TIMEOUT_S)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    records = [json.loads(line[len(REPORT_PREFIX):]) for line in collected.stdout.splitlines()
               if line.startswith(REPORT_PREFIX)]
    selected = [record for record in records if record["selected"]]
    left_out = [record for record in records if not record["selected"]]
    assert len(selected) > 500 and left_out, (len(selected), len(left_out))
    for record in selected:
        assert not FIXTURE_MARKERS.keys() & set(record["fixtures"]), record
        assert not set(NEEDS) & set(record["markers"]), record
    used_by_left_out = {name for record in left_out for name in record["fixtures"]}
    assert FIXTURE_MARKERS.keys() <= used_by_left_out, FIXTURE_MARKERS.keys() - used_by_left_out
