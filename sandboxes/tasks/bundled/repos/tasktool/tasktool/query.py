"""Filter and sort tasks with the small query language of ``tasktool list``.

Each term is one of ``tag:NAME``, ``done:yes|no``, ``overdue``,
``FIELD OP VALUE`` (FIELD is ``due`` or ``priority``, OP one of
``< <= > >= =``) or a plain word matched against the title. A task must
match every term.
"""

import operator
import re
from collections.abc import Callable, Iterable
from datetime import date

from tasktool.dates import parse_due
from tasktool.model import Task, TaskError, normalize_tag

Predicate = Callable[[Task], bool]

COMPARISON = re.compile(r"(due|priority)(<=|>=|<|>|=)(.+)$")
OPERATORS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
             "=": operator.eq}
SORT_KEYS = ("id", "due", "priority", "title")


def parse_query(terms: Iterable[str], today: date) -> Predicate:
    """Return a predicate that is true for tasks matching all ``terms``."""
    predicates = [parse_term(term, today) for term in terms]
    return lambda task: all(predicate(task) for predicate in predicates)


def parse_term(term: str, today: date) -> Predicate:
    if term.startswith("tag:"):
        wanted = normalize_tag(term[4:])
        return lambda task: wanted in task.tags
    if term.startswith("done:"):
        return _done_predicate(term[5:])
    if term == "overdue":
        return lambda task: task.is_overdue(today)
    match = COMPARISON.match(term)
    if match:
        field_name, symbol, raw_value = match.groups()
        return _comparison(field_name, OPERATORS[symbol], raw_value, today)
    word = term.lower()
    return lambda task: word in task.title.lower()


def _done_predicate(value: str) -> Predicate:
    if value in ("yes", "true", "1"):
        return lambda task: task.done
    if value in ("no", "false", "0"):
        return lambda task: not task.done
    raise TaskError(f"done: takes yes or no, not {value!r}")


def _comparison(field_name: str, compare: Callable, raw_value: str, today: date) -> Predicate:
    if field_name == "priority":
        try:
            threshold = int(raw_value)
        except ValueError:
            raise TaskError(f"priority must be a whole number, not {raw_value!r}") from None
        return lambda task: compare(task.priority, threshold)
    when = parse_due(raw_value, today)
    if when is None:
        raise TaskError("compare due dates with a date, for example due<friday")
    # A task without a due date is never before, after or on a date.
    return lambda task: task.due is not None and compare(task.due, when)


def sort_tasks(tasks: Iterable[Task], key: str = "id") -> list[Task]:
    """Sort by ``key``; tasks without a due date sort after all dated ones."""
    if key not in SORT_KEYS:
        raise TaskError(f"cannot sort by {key!r}; choose one of {', '.join(SORT_KEYS)}")
    if key == "due":
        return sorted(tasks, key=lambda task: (task.due is None, task.due or date.min, task.id))
    if key == "priority":
        return sorted(tasks, key=lambda task: (-task.priority, task.id))
    if key == "title":
        return sorted(tasks, key=lambda task: (task.title.lower(), task.id))
    return sorted(tasks, key=lambda task: task.id)
