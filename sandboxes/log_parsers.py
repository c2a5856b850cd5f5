"""Test-log parsers, chosen by name (`LOG_PARSERS`): a log's text in, each test's status out.
The official harness's (`swebench`, `swebench:<function>`) are in `swebench_harness.py`
(docs/sandboxes.md#grading).
"""

from collections.abc import Callable

PASSED, FAILED, ERROR, SKIPPED, XFAILED = "passed", "failed", "error", "skipped", "xfailed"
# The statuses that count as a pass (the official harness counts an expected failure).
PASSING = frozenset({PASSED, XFAILED})
_PYTEST_WORDS = {"PASSED": PASSED, "FAILED": FAILED, "ERROR": ERROR, "SKIPPED": SKIPPED,
                 "XFAIL": XFAILED}


def is_passing(status: str) -> bool:
    """Whether a test with this status counts as passing."""
    return status in PASSING


def parse_pytest_log(log: str) -> dict[str, str]:
    """Reads pytest's `-rA` short summary (`PASSED path::test`, `FAILED path::test - why`)
    exactly as swebench 4.x's `parse_log_pytest` does (`tests/sandboxes/test_parity.py`):
    a status word at the very start of a line, the test ID the next whitespace-separated
    word (a parametrized ID with a space is cut there, as in SWE-bench's own lists), `XPASS`
    no status (such a test counts as not run), and the later line wins for a test twice."""
    statuses: dict[str, str] = {}
    for line in log.split("\n"):
        word = next((w for w in _PYTEST_WORDS if line.startswith(w)), None)
        if word is None:
            continue
        if word == "FAILED":
            line = line.replace(" - ", " ")
        parts = line.split()
        if len(parts) > 1:
            statuses[parts[1]] = _PYTEST_WORDS.get(parts[0], _PYTEST_WORDS[word])
    return statuses


LOG_PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest_log,
}


def get_log_parser(name: str) -> Callable[[str], dict[str, str]]:
    try:
        return LOG_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown log parser {name!r}; choose one of {sorted(LOG_PARSERS)}, swebench "
            "(the official parser of the task's repository) or swebench:<parser function>"
        ) from None
