"""The Task record and how it is written to and read from JSON."""

from dataclasses import dataclass, field
from datetime import date


class TaskError(Exception):
    """A user-facing error: bad input, unknown task, unreadable file."""


def normalize_tag(tag: str) -> str:
    """Tags compare case-insensitively and may be written with a leading '#'."""
    return tag.strip().lstrip("#").lower()


@dataclass
class Task:
    """One to-do item. ``id`` is unique within a store and never reused."""

    id: int
    title: str
    priority: int = 1
    due: date | None = None
    tags: list[str] = field(default_factory=list)
    done: bool = False
    created: date | None = None

    def is_overdue(self, today: date) -> bool:
        return not self.done and self.due is not None and self.due < today

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "priority": self.priority,
            "due": self.due.isoformat() if self.due else None,
            "tags": list(self.tags),
            "done": self.done,
            "created": self.created.isoformat() if self.created else None,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Task":
        try:
            return cls(
                id=int(data["id"]),
                title=str(data["title"]),
                priority=int(data.get("priority", 1)),
                due=date.fromisoformat(data["due"]) if data.get("due") else None,
                tags=data.get("tags", []),
                done=bool(data.get("done", False)),
                created=date.fromisoformat(data["created"]) if data.get("created") else None,
            )
        except (KeyError, ValueError, TypeError) as error:
            raise TaskError(f"invalid task record {data!r}: {error}") from None
