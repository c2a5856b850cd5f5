import json
from datetime import date

import pytest

from tasktool.model import TaskError
from tasktool.storage import TaskStore


def test_add_save_and_reload(tmp_path):
    path = tmp_path / "tasks.json"
    store = TaskStore(path)
    store.add("First", priority=2, due=date(2024, 1, 2), tags=("#Work", "work", "Home"))
    store.add("Second")
    store.save()
    again = TaskStore(path)
    assert [task.title for task in again.tasks] == ["First", "Second"]
    assert again.tasks[0].tags == ["home", "work"]
    assert again.tasks[0].due == date(2024, 1, 2)
    assert again.next_id == 3


def test_ids_are_unique_within_a_session(tmp_path):
    store = TaskStore(tmp_path / "tasks.json")
    first = store.add("a")
    store.remove(first.id)
    second = store.add("b")
    assert second.id != first.id


def test_unknown_task_and_empty_title(tmp_path):
    store = TaskStore(tmp_path / "tasks.json")
    with pytest.raises(TaskError, match="no task #4"):
        store.get(4)
    with pytest.raises(TaskError):
        store.add("   ")


def test_version_1_file_is_upgraded(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([{"id": 1, "title": "old", "done": True}]))
    store = TaskStore(path)
    (task,) = store.tasks
    assert (task.title, task.done, task.priority, task.tags) == ("old", True, 1, [])
    assert store.next_id == 2


def test_corrupt_file_is_a_task_error(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text("{not json")
    with pytest.raises(TaskError, match="cannot read"):
        TaskStore(path)
