"""Task sets that ship their repositories, and the stamping of their base commits
(`undertow tasks stamp`); the layout: docs/sandboxes.md#task-sets-that-ship-their-repositories.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import compute_base_commit

BUNDLED_DIR = Path(__file__).resolve().parent / "tasks" / "bundled"


@dataclass(frozen=True)
class Stamp:
    """One task's recorded and computed base commit."""

    instance_id: str
    recorded: str
    computed: str

    @property
    def matches(self) -> bool:
        return self.recorded == self.computed


def _tasks_file(folder: Path) -> Path:
    path = folder / "tasks.jsonl" if folder.is_dir() else folder
    if not path.exists():
        raise FileNotFoundError(f"no tasks.jsonl in {folder}")
    return path


def check_stamps(folder: Path) -> list[Stamp]:
    """Recorded versus computed base commit for every task that ships its source."""
    path = _tasks_file(folder)
    return [Stamp(task.instance_id, task.base_commit, compute_base_commit(task))
            for task in load_tasks(path) if task.image is None]


def stamp_task_set(folder: Path) -> list[Stamp]:
    """Writes each computed base commit into tasks.jsonl; returns the stamps."""
    path = _tasks_file(folder)
    stamps = {stamp.instance_id: stamp for stamp in check_stamps(path)}
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            stamp = stamps.get(record["instance_id"])
            if stamp is not None:
                record["base_commit"] = stamp.computed
            line = json.dumps(record, ensure_ascii=False)
        lines.append(line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return list(stamps.values())
