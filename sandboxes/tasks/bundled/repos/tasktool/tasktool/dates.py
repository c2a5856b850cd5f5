"""Parse the due dates people type: 'tomorrow', 'friday', '+2w', '2024-05-01'.

All parsing is relative to an explicit ``today`` so that results do not
depend on when the code runs.
"""

import calendar
import re
from datetime import date, timedelta

from tasktool.model import TaskError

WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
RELATIVE = re.compile(r"\+(\d+)([dwm])$")


def add_months(start: date, num_months: int) -> date:
    """Return the same day ``num_months`` later, clamped to the end of a shorter month."""
    month_index = start.month - 1 + num_months
    year = start.year + month_index // 12
    month = month_index % 12 + 1
    last_day = calendar.monthrange(year, month)[1]
    return date(year, month, min(start.day, last_day))


def next_weekday(today: date, weekday: int) -> date:
    """Return the next date after ``today`` falling on ``weekday`` (0 = Monday), never today."""
    days_ahead = (weekday - today.weekday()) % 7
    if days_ahead == 0:
        days_ahead = 7
    return today + timedelta(days=days_ahead)


def parse_due(text: str, today: date) -> date | None:
    """Parse a due date; 'none' or '' clears it (returns None)."""
    word = text.strip().lower()
    if word in ("", "none"):
        return None
    if word == "today":
        return today
    if word == "tomorrow":
        return today + timedelta(days=1)
    if word in WEEKDAYS:
        return next_weekday(today, WEEKDAYS.index(word))
    match = RELATIVE.match(word)
    if match:
        amount, unit = int(match.group(1)), match.group(2)
        if unit == "d":
            return today + timedelta(days=amount)
        if unit == "w":
            return today + timedelta(weeks=amount)
        return add_months(today, amount)
    try:
        return date.fromisoformat(word)
    except ValueError:
        raise TaskError(
            f"cannot read due date {text!r}; use today, tomorrow, a weekday, +3d, +2w, +1m "
            "or YYYY-MM-DD"
        ) from None


def describe_due(due: date | None, today: date) -> str:
    """Return a short human description: 'today', 'tomorrow', 'in 3d', '2d ago' or the date."""
    if due is None:
        return ""
    num_days = (due - today).days
    if num_days == 0:
        return "today"
    if num_days == 1:
        return "tomorrow"
    if 1 < num_days <= 14:
        return f"in {num_days}d"
    if -14 <= num_days < 0:
        return f"{-num_days}d ago"
    return due.isoformat()
