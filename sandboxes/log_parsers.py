"""Test-log parsers, chosen by name: a log's text in, each test's status out.

A task's `log_parser` names one of `LOG_PARSERS` (Undertow's own, for task sets that
name theirs, such as the bundled one), or `swebench` (the official harness's parser
for the task's repository) or `swebench:<function>` (one of its parsers by name);
those two live in `swebench_harness.py`. A parser maps test IDs (as the task's
FAIL_TO_PASS and PASS_TO_PASS name them) to one of the statuses below. A new test
runner is a new function added to the dict.

The pytest parser reads a log exactly as the official SWE-bench harness
(`swebench` 4.x, `parse_log_pytest`) does, so that a reward never disagrees with the
leaderboard's verdict on the same log (`tests/sandboxes/test_parity.py` checks it):
a summary line is a status word at the very start of the line, the test ID is the
next whitespace-separated word (a parametrized ID with a space is cut there, as in
SWE-bench's own FAIL_TO_PASS lists), `XPASS` is not a status (such a test counts as
not run), and when a test is reported twice the later line wins.
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
    """Reads pytest's `-rA` short summary (`PASSED path::test`, `FAILED path::test - why`)."""
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
