"""The pytest log parser and the parser registry."""

import pytest

from undertow.sandboxes.log_parsers import get_log_parser, parse_pytest_log

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
"""


def test_summary_lines_with_worst_status_winning():
    statuses = parse_pytest_log(RA_LOG)
    assert statuses == {
        "tests/test_a.py::test_one": "passed",
        "tests/test_a.py::test_param[a b]": "passed",
        "tests/test_a.py::test_two": "failed",
        "tests/test_a.py::test_teardown": "error",
        "tests/test_a.py::test_known": "skipped",
    }


def test_verbose_lines_when_no_summary():
    log = ("tests/test_b.py::test_x PASSED      [ 50%]\n"
           "\x1b[31mtests/test_b.py::test_y FAILED\x1b[0m      [100%]\n")
    assert parse_pytest_log(log) == {"tests/test_b.py::test_x": "passed",
                                     "tests/test_b.py::test_y": "failed"}


def test_registry_by_name():
    assert get_log_parser("pytest") is parse_pytest_log
    with pytest.raises(ValueError, match=r"unknown log parser 'junit'.*pytest"):
        get_log_parser("junit")
