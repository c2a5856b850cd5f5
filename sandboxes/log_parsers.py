"""Test-log parsers, chosen by name: a log's text in, each test's status out.

A task's `log_parser` names one of `LOG_PARSERS`. A parser maps test IDs (as the
task's FAIL_TO_PASS and PASS_TO_PASS name them) to one of the statuses below. A
new test runner is a new function added to the dict.
"""

import re
from collections.abc import Callable

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
# When a test is reported twice (a pass, then an error in its teardown), the worse one wins.
_RANK = {SKIPPED: 0, PASSED: 1, FAILED: 2, ERROR: 3}
_PYTEST_WORDS = {"PASSED": PASSED, "XPASS": PASSED, "FAILED": FAILED, "XFAIL": SKIPPED,
                 "ERROR": ERROR, "SKIPPED": SKIPPED}
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S.*)$")
_VERBOSE_LINE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _record(statuses: dict[str, str], test_id: str, status: str) -> None:
    if _RANK[status] >= _RANK.get(statuses.get(test_id, SKIPPED), 0):
        statuses[test_id] = status


def parse_pytest_log(log: str) -> dict[str, str]:
    """Reads pytest's `-rA` short summary (`PASSED path::test`), else its `-v` lines."""
    summary: dict[str, str] = {}
    verbose: dict[str, str] = {}
    for raw in log.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        if match := _SUMMARY_LINE.match(line):
            word, rest = match.groups()
            if word == "SKIPPED" and rest.startswith("["):
                continue  # "SKIPPED [1] file.py:12: reason" names no test ID
            if word in ("FAILED", "ERROR", "XFAIL", "XPASS") and " - " in rest:
                rest = rest.split(" - ", 1)[0]
            _record(summary, rest.strip(), _PYTEST_WORDS[word])
        elif match := _VERBOSE_LINE.match(line):
            test_id, word = match.groups()
            _record(verbose, test_id, _PYTEST_WORDS[word])
    return summary or verbose


LOG_PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest_log,
}


def get_log_parser(name: str) -> Callable[[str], dict[str, str]]:
    try:
        return LOG_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown log parser {name!r}; choose one of {sorted(LOG_PARSERS)}") from None
