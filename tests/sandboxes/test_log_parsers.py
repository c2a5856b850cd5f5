"""The pytest log parser (the official harness's reading of a log) and the parser registry."""

import pytest

from undertow.sandboxes.log_parsers import get_log_parser, is_passing, parse_pytest_log

RA_LOG = """\
============================= test session starts ==============================
collected 5 items

tests/test_a.py .F.sE                                                    [100%]
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_param[a b]
PASSED tests/test_a.py::test_teardown
SKIPPED [1] tests/test_a.py:9: not today
FAILED tests/test_a.py::test_two - AssertionError: assert 1 == 2
ERROR tests/test_a.py::test_teardown - RuntimeError: boom
XFAIL tests/test_a.py::test_known - flaky upstream
XPASS tests/test_a.py::test_lucky
"""


def test_summary_lines_as_the_official_harness_reads_them():
    statuses = parse_pytest_log(RA_LOG)
    assert statuses == {
        "tests/test_a.py::test_one": "passed",
        # The ID ends at the first space, as in SWE-bench's own FAIL_TO_PASS lists.
        "tests/test_a.py::test_param[a": "passed",
        "[1]": "skipped",
        "tests/test_a.py::test_two": "failed",
        # Reported twice: the later line wins.
        "tests/test_a.py::test_teardown": "error",
        "tests/test_a.py::test_known": "xfailed",
    }
    assert "tests/test_a.py::test_lucky" not in statuses
    assert is_passing(statuses["tests/test_a.py::test_known"])
    assert not is_passing(statuses["tests/test_a.py::test_two"])


def test_verbose_lines_name_no_verdict():
    log = ("tests/test_b.py::test_x PASSED      [ 50%]\n"
           "\x1b[31mFAILED\x1b[0m tests/test_b.py::test_y\n")
    assert parse_pytest_log(log) == {}


def test_registry_by_name():
    assert get_log_parser("pytest") is parse_pytest_log
    with pytest.raises(ValueError, match=r"unknown log parser 'junit'.*pytest.*swebench"):
        get_log_parser("junit")
