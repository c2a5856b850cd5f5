"""Task loading: JSONL, SWE-bench's JSON-string lists, local Hugging Face datasets, and errors."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from undertow.sandboxes.errors import TaskFormatError
from undertow.sandboxes.task import DEFAULT_TEST_CMD, load_tasks, parse_task, task_record

RECORD = {
    "instance_id": "owner__repo-1", "repo": "owner/repo", "base_commit": "abc",
    "problem_statement": "it breaks", "patch": "diff --git a/x b/x\n", "test_patch": "",
    "FAIL_TO_PASS": '["tests/test_x.py::test_a"]', "PASS_TO_PASS": "[]",
    "version": "1.0", "environment_setup_commit": "def",
}


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_swe_bench_record_loads_with_defaults(tmp_path):
    task = load_tasks(_write_jsonl(tmp_path / "tasks.jsonl", [RECORD]))[0]
    assert task.FAIL_TO_PASS == ("tests/test_x.py::test_a",)
    assert task.PASS_TO_PASS == ()
    assert task.test_cmd == DEFAULT_TEST_CMD and task.log_parser == "pytest"
    assert task.image is None and task.source_dir == tmp_path / "repos" / "repo"


def test_folder_with_tasks_jsonl_and_explicit_fields(tmp_path):
    record = {**RECORD, "image": "swebench/x:latest", "timeout_s": 30, "PASS_TO_PASS": ["t::b"]}
    _write_jsonl(tmp_path / "tasks.jsonl", [record])
    task = load_tasks(tmp_path)[0]
    assert (task.image, task.timeout_s, task.PASS_TO_PASS) == ("swebench/x:latest", 30.0, ("t::b",))
    assert task.source_dir is None


def test_record_round_trips_through_task_record(tmp_path):
    task = load_tasks(_write_jsonl(tmp_path / "tasks.jsonl", [RECORD]))[0]
    again = parse_task(task_record(task, tmp_path), "again", tmp_path)
    assert again == task


@pytest.mark.parametrize(("change", "message"), [
    ({"FAIL_TO_PASS": None}, "'FAIL_TO_PASS' must be a list"),
    ({"FAIL_TO_PASS": "[not json"}, "'FAIL_TO_PASS' is a string but not a JSON list"),
    ({"PASS_TO_PASS": [1, 2]}, "'PASS_TO_PASS' must be a list of test IDs"),
    ({"patch": 3}, "'patch' must be a string, got int"),
    ({"timeout_s": -1}, "'timeout_s' must be a positive number"),
    ({"test_cmd": ["pytest"]}, "'test_cmd' must be a string"),
])
def test_malformed_field_names_field_instance_and_line(tmp_path, change, message):
    path = _write_jsonl(tmp_path / "tasks.jsonl", [
        {**RECORD, "instance_id": "ok-1"}, {**RECORD, **change}])
    with pytest.raises(TaskFormatError) as error:
        load_tasks(path)
    assert message in str(error.value)
    assert "line 2" in str(error.value) and "owner__repo-1" in str(error.value)


def test_missing_field_and_missing_instance_id(tmp_path):
    record = dict(RECORD)
    del record["test_patch"]
    with pytest.raises(TaskFormatError, match=r"line 1 .*'test_patch' is missing"):
        load_tasks(_write_jsonl(tmp_path / "a.jsonl", [record]))
    with pytest.raises(TaskFormatError, match="line 1: field 'instance_id' is missing"):
        load_tasks(_write_jsonl(tmp_path / "b.jsonl", [{**RECORD, "instance_id": ""}]))


def test_bad_json_line_and_duplicates(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(RECORD) + "\n\n{oops\n")
    with pytest.raises(TaskFormatError, match="line 3: not valid JSON"):
        load_tasks(path)
    with pytest.raises(TaskFormatError, match=r"repeats .* line 1"):
        load_tasks(_write_jsonl(path, [RECORD, RECORD]))
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "absent.jsonl")


def test_local_hugging_face_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    other = {**RECORD, "instance_id": "owner__repo-2", "FAIL_TO_PASS": '["t::c"]'}
    dataset = datasets.Dataset.from_list([RECORD, other])
    dataset.save_to_disk(str(tmp_path / "saved"))
    saved = load_tasks(tmp_path / "saved")
    assert [task.instance_id for task in saved] == ["owner__repo-1", "owner__repo-2"]
    assert saved[1].FAIL_TO_PASS == ("t::c",)
    (tmp_path / "parquet").mkdir()
    dataset.to_parquet(str(tmp_path / "parquet" / "test-00000.parquet"))
    from_parquet = load_tasks(tmp_path / "parquet")
    assert [replace(task, source_dir=None) for task in from_parquet] == [
        replace(task, source_dir=None) for task in saved]
    broken = datasets.Dataset.from_list([{**RECORD, "FAIL_TO_PASS": "{}"}])
    broken.save_to_disk(str(tmp_path / "broken"))
    with pytest.raises(TaskFormatError, match=r"row 0 \(instance owner__repo-1\).*FAIL_TO_PASS"):
        load_tasks(tmp_path / "broken")


def test_swe_bench_fields_and_official_commands():
    task = parse_task(RECORD, "here")
    assert (task.version, task.environment_setup_commit) == ("1.0", "def")
    assert (task.pre_install, task.eval_commands) == ((), ())  # owner/repo: swebench knows none
    numeric = parse_task({**RECORD, "version": 3.0}, "here")
    assert numeric.version == "3.0"
    given = parse_task({**RECORD, "pre_install": ["apt-get update"], "eval_commands": "export A=1"},
                       "here")
    assert (given.pre_install, given.eval_commands) == (("apt-get update",), ("export A=1",))
    with pytest.raises(TaskFormatError, match="'eval_commands' must be a list of shell commands"):
        parse_task({**RECORD, "eval_commands": [1]}, "here")
    known = parse_task({**RECORD, "repo": "django/django", "version": "3.0"}, "here")
    assert known.log_parser == "swebench" and known.test_cmd.startswith("./tests/runtests.py")
    assert known.pre_install or known.eval_commands
    record = task_record(known)
    assert parse_task(record, "again") == known
