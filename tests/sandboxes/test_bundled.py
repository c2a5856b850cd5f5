"""The bundled task set: every gold patch scores 1, every empty diff scores 0.

Its base commits must match what its shipped sources produce (`undertow tasks
stamp --check`). Grading runs once per task for each diff; `undertow tasks
validate sandboxes/tasks/bundled` does the fuller three-run check.
"""

import asyncio

import pytest

from undertow.sandboxes.grading import grade
from undertow.sandboxes.task import load_tasks
from undertow.sandboxes.task_image import ensure_task_image
from undertow.sandboxes.taskset import BUNDLED_DIR, check_stamps

HAS_TASKS = (BUNDLED_DIR / "tasks.jsonl").exists()
TASKS = load_tasks(BUNDLED_DIR) if HAS_TASKS else []
needs_tasks = pytest.mark.skipif(not HAS_TASKS, reason="the bundled tasks.jsonl is not written yet")


@needs_tasks
def test_bundled_set_size_and_stamps():
    assert len(TASKS) >= 24
    assert len({task.repo for task in TASKS}) >= 4
    stale = [stamp.instance_id for stamp in check_stamps(BUNDLED_DIR) if not stamp.matches]
    assert stale == [], "run `undertow tasks stamp sandboxes/tasks/bundled`"


@pytest.mark.docker
@pytest.mark.parametrize("task", TASKS, ids=[task.instance_id for task in TASKS])
async def test_gold_patch_scores_one_and_empty_diff_zero(task, docker_connection, docker_run,
                                                        base_image):
    image = await ensure_task_image(docker_connection, task)
    gold, empty = await asyncio.gather(
        grade(docker_connection, task, task.patch, run=docker_run, image=image),
        grade(docker_connection, task, "", run=docker_run, image=image))
    assert (gold.reward, gold.resolved) == (1.0, True), gold.reason + "\n" + gold.log_tail
    assert empty.reward == 0.0, empty.reason
