from datetime import date

import pytest

from tasktool.dates import add_months, describe_due, parse_due
from tasktool.model import TaskError

WEDNESDAY = date(2024, 5, 15)


def test_words_and_iso_dates():
    assert parse_due("today", WEDNESDAY) == WEDNESDAY
    assert parse_due("Tomorrow", WEDNESDAY) == date(2024, 5, 16)
    assert parse_due("2024-12-24", WEDNESDAY) == date(2024, 12, 24)
    assert parse_due("none", WEDNESDAY) is None


def test_weekday_names_look_ahead():
    assert parse_due("friday", WEDNESDAY) == date(2024, 5, 17)
    assert parse_due("monday", WEDNESDAY) == date(2024, 5, 20)


def test_relative_days_and_weeks():
    assert parse_due("+3d", WEDNESDAY) == date(2024, 5, 18)
    assert parse_due("+2w", WEDNESDAY) == date(2024, 5, 29)


def test_relative_months():
    assert parse_due("+1m", WEDNESDAY) == date(2024, 6, 15)
    assert add_months(date(2024, 11, 10), 3) == date(2025, 2, 10)


def test_bad_date_is_a_task_error():
    with pytest.raises(TaskError, match="cannot read due date"):
        parse_due("someday", WEDNESDAY)


def test_describe_due():
    assert describe_due(WEDNESDAY, WEDNESDAY) == "today"
    assert describe_due(date(2024, 5, 16), WEDNESDAY) == "tomorrow"
    assert describe_due(date(2024, 5, 20), WEDNESDAY) == "in 5d"
    assert describe_due(date(2024, 5, 13), WEDNESDAY) == "2d ago"
    assert describe_due(date(2024, 9, 1), WEDNESDAY) == "2024-09-01"
