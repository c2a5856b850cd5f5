"""Task-set stamping and `undertow tasks validate`."""

import json
from dataclasses import replace

import pytest

from undertow.cli import main
from undertow.sandboxes.taskset import check_stamps, stamp_task_set
from undertow.sandboxes.validation import format_checks, validate_task


def test_stamp_fills_and_check_detects_stale_base_commits(task_set_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "set"
    shutil.copytree(task_set_dir, copy)
    right = json.loads((copy / "tasks.jsonl").read_text())["base_commit"]
    record = json.loads((copy / "tasks.jsonl").read_text())
    record["base_commit"] = "0" * 40
    (copy / "tasks.jsonl").write_text(json.dumps(record) + "\n")
    assert [stamp.matches for stamp in check_stamps(copy)] == [False]
    assert main(["tasks", "stamp", str(copy), "--check"]) == 1
    assert "is stale" in capsys.readouterr().out
    stamps = stamp_task_set(copy)
    assert [stamp.computed for stamp in stamps] == [right]
    assert json.loads((copy / "tasks.jsonl").read_text())["base_commit"] == right
    assert main(["tasks", "stamp", str(copy), "--check"]) == 0


@pytest.mark.docker
async def test_validate_flags_a_task_whose_tests_do_not_decide_it(
        docker_connection, docker_run, fixture_image, fixture_task):
    wrong = replace(fixture_task, base_commit="", FAIL_TO_PASS=(
        *fixture_task.FAIL_TO_PASS, fixture_task.PASS_TO_PASS[0]))
    check = await validate_task(docker_connection, wrong, run=docker_run, num_runs=1)
    assert not check.ok
    assert check.problems == (
        f"base_commit (empty) is not {fixture_task.base_commit}, the hash its source gives: "
        "run `undertow tasks stamp` on the task set",
        f"FAIL_TO_PASS {fixture_task.PASS_TO_PASS[0]} passes without the gold patch")
    assert "FAIL" in format_checks([check])


@pytest.mark.docker
def test_validate_command_passes_the_fixture_set(task_set_dir, fixture_image, capsys):
    assert main(["tasks", "validate", str(task_set_dir), "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "| minimath-1 | ok | undertow | 2 |" in out and "1/1 tasks valid" in out


def test_the_table_names_who_decided_each_verdict():
    from undertow.sandboxes.validation import TaskCheck

    checks = [TaskCheck("django__django-1", 1, (), 2.0, "swebench"),
              TaskCheck("minimath-1", 1, ("flaky: t",), 1.0, "undertow")]
    table = format_checks(checks)
    assert "| django__django-1 | ok | swebench | 1 |" in table
    assert "| minimath-1 | FAIL | undertow | 1 |" in table
    assert "1/2 tasks valid; verdicts decided by swebench for 1, by undertow for 1" in table
