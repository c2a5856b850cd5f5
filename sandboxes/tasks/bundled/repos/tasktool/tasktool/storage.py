"""Read and write the task file.

The file is JSON: ``{"version": 2, "next_id": N, "tasks": [...]}``. Version 1
files (a bare list of tasks, no tags or priority) are upgraded on load.
Writes go to a temporary file that is then renamed over the old one, so a
crash never leaves a half-written file.
"""

import copy
import json
import os
import tempfile
from datetime import date
from pathlib import Path

from tasktool.model import Task, TaskError, normalize_tag

FORMAT_VERSION = 2
V1_DEFAULTS = {"priority": 1, "tags": [], "created": None}


class TaskStore:
    """The tasks of one file. Invariant: ``next_id`` is greater than every id ever used."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tasks: list[Task] = []
        self.next_id = 1
        if self.path.exists():
            self._load()

    def add(self, title: str, *, priority: int = 1, due: date | None = None,
            tags: tuple[str, ...] = (), created: date | None = None) -> Task:
        if not title.strip():
            raise TaskError("a task needs a title")
        task = Task(
            id=self.next_id,
            title=title.strip(),
            priority=priority,
            due=due,
            tags=sorted({normalize_tag(tag) for tag in tags}),
            created=created,
        )
        self.next_id += 1
        self.tasks.append(task)
        return task

    def get(self, task_id: int) -> Task:
        for task in self.tasks:
            if task.id == task_id:
                return task
        raise TaskError(f"there is no task #{task_id}; see 'tasktool list --all'")

    def remove(self, task_id: int) -> Task:
        task = self.get(task_id)
        self.tasks.remove(task)
        return task

    def save(self) -> None:
        data = {
            "version": FORMAT_VERSION,
            "next_id": self.next_id,
            "tasks": [task.to_dict() for task in self.tasks],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp_name = tempfile.mkstemp(dir=self.path.parent, prefix=".tasks-")
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(data, file, indent=2)
            file.write("\n")
        os.replace(temp_name, self.path)

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise TaskError(f"cannot read {self.path}: {error}") from None
        if isinstance(data, list):
            data = _upgrade_v1(data)
        if data.get("version") != FORMAT_VERSION:
            raise TaskError(f"{self.path} has unknown format version {data.get('version')!r}")
        self.tasks = [Task.from_dict(record) for record in data["tasks"]]
        highest_id = max((task.id for task in self.tasks), default=0)
        self.next_id = max(int(data.get("next_id", 1)), highest_id + 1)


def _upgrade_v1(records: list) -> dict:
    """Turn a version 1 file (a list of tasks) into the version 2 layout."""
    tasks = []
    for record in records:
        record = dict(record)
        for key, default in V1_DEFAULTS.items():
            record.setdefault(key, copy.deepcopy(default))
        tasks.append(record)
    return {"version": FORMAT_VERSION, "next_id": 1, "tasks": tasks}
