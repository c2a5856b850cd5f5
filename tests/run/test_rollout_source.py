"""The rollout source both runs import (`undertow/run/rollout_source.py`), directly: the loop
thread, the choice of `run_group`, task selection, and `ThreadedGroupSource` handing a
finished group from the loop thread to the learner's thread."""

import asyncio
import threading

import pytest

from undertow.learner.train import GroupRequest
from undertow.run.rollout_source import (
    GroupOutcome,
    RolloutContext,
    ThreadedGroupSource,
    background_loop,
    load_source,
    select_prompt_tasks,
    task_at,
)
from undertow.run.sections import RolloutSection


def context_of(tmp_path, **rollout) -> RolloutContext:
    return RolloutContext("http://127.0.0.1:1", "token", tmp_path, RolloutSection(**rollout),
                          None)


def factory(context):
    """A `rollout.source` factory: each group opens no session and says so."""
    async def run_group(request):
        return GroupOutcome(request.group_id, 0, {"crash": 1}, 2, "boom")
    return run_group


def test_background_loop_runs_coroutines_off_the_calling_thread_and_stops():
    async def thread_name():
        return threading.current_thread().name

    with background_loop() as loop:
        name = asyncio.run_coroutine_threadsafe(thread_name(), loop).result(timeout=10)
    assert name == "undertow-rollouts"
    assert loop.is_closed()


def test_load_source_imports_the_named_factory_and_calls_it_with_the_context(tmp_path):
    run_group = load_source(context_of(tmp_path, source=f"{__name__}:factory"))
    outcome = asyncio.run(run_group(GroupRequest(3, "g3", 2, 0)))
    assert outcome == GroupOutcome("g3", 0, {"crash": 1}, 2, "boom")


def test_load_source_without_a_colon_names_the_bad_value(tmp_path):
    with pytest.raises(ValueError,
                       match=r"'tests\.run\.test_rollout_source' must be 'module:factory'"):
        load_source(context_of(tmp_path, source=__name__))


def test_select_prompt_tasks_filters_by_id_and_count_and_refuses_an_empty_selection(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(
        f'{{"instance_id": "t{i}", "prompt": "p{i}", '
        f'"reward": "undertow.adapters.rewards:exact_answer"}}\n' for i in range(4)))
    picked = select_prompt_tasks(RolloutSection(tasks=tasks, instance_ids=("t2", "t0")))
    assert [t.instance_id for t in picked] == ["t0", "t2"]
    assert [t.instance_id for t in select_prompt_tasks(RolloutSection(tasks=tasks, num_tasks=3))
            ] == ["t0", "t1", "t2"]
    assert [t.instance_id for t in select_prompt_tasks(RolloutSection())] == ["one-direction"]
    with pytest.raises(ValueError, match=r"no task \['no-such-task'\] in .*tasks.jsonl"):
        select_prompt_tasks(RolloutSection(tasks=tasks, instance_ids=("t1", "no-such-task")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"no task selected from .*empty\.jsonl"):
        select_prompt_tasks(RolloutSection(tasks=tmp_path / "empty.jsonl"))


def test_groups_go_through_every_task_once_a_pass_in_a_seeded_shuffled_order():
    # A set sorted by repository, as generated sets are: in order, the first 20 groups
    # would all be `ledger`.
    tasks = [f"{repo}-{i}" for repo in ("ledger", "orbit", "quill") for i in range(20)]
    section = RolloutSection()
    first, second = ([task_at(tasks, index, section) for index in range(start, start + 60)]
                     for start in (0, 60))
    assert sorted(first) == sorted(second) == sorted(tasks)
    assert first != second and first != tasks
    assert {task.split("-")[0] for task in first[:20]} == {"ledger", "orbit", "quill"}
    # A resumed run asks for its next group by index alone and gets the same task.
    assert [task_at(list(tasks), index, RolloutSection()) for index in range(60, 120)] == second
    assert [task_at(tasks, index, RolloutSection(seed=1)) for index in range(60)] != first
    assert [task_at(tasks, index, RolloutSection(shuffle=False)) for index in range(90)
            ] == tasks + tasks[:30]


def test_threaded_source_hands_a_group_run_on_the_loop_to_the_learner(tmp_path):
    run_group = load_source(context_of(tmp_path, source=f"{__name__}:factory"))
    with background_loop() as loop:
        source = ThreadedGroupSource(loop, run_group, admin=None)
        source.launch(GroupRequest(5, "g5", 2, 0))
        finished = []
        while not finished:
            finished += source.wait(timeout_s=10)
    [group] = finished
    assert (group.index, group.tree.group_id, group.failures) == (5, "g5", {"crash": 1})
    assert (group.num_reruns, group.error) == (2, "boom")
    assert not source.futures
