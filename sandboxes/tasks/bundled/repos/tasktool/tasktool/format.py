"""Render tasks as a fixed-width text table for the terminal."""

from collections.abc import Sequence
from datetime import date

from tasktool.dates import describe_due
from tasktool.model import Task

ELLIPSIS = "…"


def fit(text: str, width: int) -> str:
    """Pad or cut ``text`` to exactly ``width`` characters, marking cuts with an ellipsis."""
    if len(text) <= width:
        return text.ljust(width)
    return text[: width - 1] + ELLIPSIS


def render_table(tasks: Sequence[Task], today: date, width: int = 80) -> str:
    """Return the table of ``tasks``: one header line and one line per task.

    Every line is exactly ``width`` characters wide; the title column takes
    whatever the fixed columns leave. Overdue tasks are marked with '!'.
    """
    if not tasks:
        return "no tasks"
    id_width = max(len(str(task.id)) for task in tasks) + 1
    fixed = [("id", id_width), ("", 1), ("pri", 3), ("due", 10), ("tags", 14)]
    title_width = max(10, width - sum(w for _, w in fixed) - len(fixed))
    lines = [_row(["#", "", "pri", "due", "tags", "title"], fixed, title_width)]
    for task in tasks:
        mark = "!" if task.is_overdue(today) else ("x" if task.done else " ")
        cells = [
            str(task.id),
            mark,
            "*" * task.priority,
            describe_due(task.due, today),
            " ".join(task.tags),
            task.title,
        ]
        lines.append(_row(cells, fixed, title_width))
    return "\n".join(lines)


def _row(cells: list[str], fixed: list[tuple[str, int]], title_width: int) -> str:
    parts = [fit(cell, column_width) for cell, (_, column_width) in zip(cells, fixed, strict=False)]
    parts.append(fit(cells[-1], title_width))
    return " ".join(parts)


def render_stats(tasks: Sequence[Task], today: date) -> str:
    num_done = sum(task.done for task in tasks)
    num_overdue = sum(task.is_overdue(today) for task in tasks)
    return f"{len(tasks)} tasks: {num_done} done, {len(tasks) - num_done} open, {num_overdue} overdue"
