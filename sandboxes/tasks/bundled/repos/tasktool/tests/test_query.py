from datetime import date

import pytest

from tasktool.model import Task, TaskError
from tasktool.query import parse_query, sort_tasks

TODAY = date(2024, 5, 15)
TASKS = [
    Task(1, "Write report", priority=2, due=date(2024, 5, 10), tags=["work"]),
    Task(2, "Buy milk", priority=1, due=date(2024, 5, 20), tags=["home"]),
    Task(3, "Call mom", priority=3, due=date(2024, 5, 16), tags=["home"], done=True),
]


def ids(terms, tasks=TASKS):
    return [task.id for task in tasks if parse_query(terms, TODAY)(task)]


def test_tag_and_done_filters():
    assert ids(["tag:home"]) == [2, 3]
    assert ids(["tag:home", "done:no"]) == [2]


def test_title_words():
    assert ids(["MILK"]) == [2]
    assert ids(["call", "mom"]) == [3]


def test_due_comparisons():
    assert ids(["due<2024-05-16"]) == [1]
    assert ids(["due>2024-05-16"]) == [2]
    assert ids(["due=tomorrow"]) == [3]


def test_priority_comparisons():
    assert ids(["priority>2"]) == [3]
    assert ids(["priority<2"]) == [2]


def test_overdue():
    assert ids(["overdue"]) == [1]


def test_bad_terms():
    with pytest.raises(TaskError):
        parse_query(["done:maybe"], TODAY)
    with pytest.raises(TaskError):
        parse_query(["priority<high"], TODAY)


def test_sorting():
    undated = Task(4, "Someday", priority=1)
    tasks = [*TASKS, undated]
    assert [t.id for t in sort_tasks(tasks, "due")] == [1, 3, 2, 4]
    assert [t.id for t in sort_tasks(tasks, "priority")] == [3, 1, 2, 4]
    assert [t.id for t in sort_tasks(tasks, "title")] == [2, 3, 4, 1]
    with pytest.raises(TaskError):
        sort_tasks(tasks, "colour")
