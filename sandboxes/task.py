"""The task record (one SWE instance: SWE-bench's fields, plus how to run it) and its loaders.

The fields, the set-up each kind of field gets, and what `load_tasks` reads:
docs/sandboxes.md#tasks.
"""

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from undertow.sandboxes import swebench_harness
from undertow.sandboxes.errors import TaskFormatError

DEFAULT_TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
DEFAULT_WORKDIR = "/testbed"


@dataclass(frozen=True)
class Task:
    """One SWE instance.

    Invariants: `instance_id` is non-empty; `FAIL_TO_PASS` and `PASS_TO_PASS` are
    tuples of test IDs as the task's log parser names them; `timeout_s` > 0;
    `image` is None when the image is to be built from `source_dir` (then
    `source_dir` is set and `base_commit` is the hash `task_image` produces: a commit
    the repository at `source_dir` holds, kept as given, or the stamped one).
    """

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    image: str | None = None
    test_cmd: str = DEFAULT_TEST_CMD
    log_parser: str = "pytest"
    timeout_s: float = 300.0
    source_dir: Path | None = None
    workdir: str = DEFAULT_WORKDIR
    version: str = ""
    environment_setup_commit: str = ""
    pre_install: tuple[str, ...] = ()
    eval_commands: tuple[str, ...] = ()
    start_commands: tuple[str, ...] = ()


_TEXT_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch")
_LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")
_COMMAND_FIELDS = ("pre_install", "eval_commands")
_RECORD_COMMAND_FIELDS = (*_COMMAND_FIELDS, "start_commands")


def _fail(field: str, message: str, where: str) -> TaskFormatError:
    return TaskFormatError(f"{where}: field {field!r} {message}")


def _test_list(value: object, field: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as error:
            raise _fail(field, f"is a string but not a JSON list ({error})", where) from None
    if not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
        raise _fail(field, f"must be a list of test IDs, got {type(value).__name__}", where)
    return tuple(value)


def _optional_text(record: Mapping[str, Any], field: str, default: str | None,
                   where: str) -> str | None:
    value = record.get(field)
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise _fail(field, f"must be a string, got {type(value).__name__}", where)
    return value


def parse_task(record: Mapping[str, Any], where: str, base_dir: Path | None = None) -> Task:
    """Builds a Task from one record; `where` (e.g. "tasks.jsonl line 3") goes into errors."""
    if not isinstance(record, Mapping):
        raise TaskFormatError(f"{where}: a task must be a JSON object, got {type(record).__name__}")
    instance_id = record.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id:
        raise _fail("instance_id", "is missing or empty", where)
    where = f"{where} (instance {instance_id})"
    values: dict[str, Any] = {}
    for field in _TEXT_FIELDS:
        value = record.get(field)
        if value is None and field == "base_commit":
            value = ""
        if not isinstance(value, str):
            kind = type(value).__name__
            problem = "is missing" if value is None else f"must be a string, got {kind}"
            raise _fail(field, problem, where)
        values[field] = value
    for field in _LIST_FIELDS:
        if field not in record:
            raise _fail(field, "is missing", where)
        values[field] = _test_list(record[field], field, where)
    values["image"] = _optional_text(record, "image", None, where)
    values["workdir"] = _optional_text(record, "workdir", DEFAULT_WORKDIR, where)
    values["version"] = _version(record.get("version"), where)
    values["environment_setup_commit"] = _optional_text(
        record, "environment_setup_commit", "", where)
    values.update(_how_to_test(record, values, where))
    values["start_commands"] = _commands(record, "start_commands", where) or ()
    timeout_s = record.get("timeout_s", 300.0)
    if timeout_s is None:
        timeout_s = 300.0
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise _fail("timeout_s", f"must be a positive number of seconds, got {timeout_s!r}", where)
    values["timeout_s"] = float(timeout_s)
    values["source_dir"] = _source_dir(record, values, base_dir, where)
    return Task(**values)


def _version(value: object, where: str) -> str:
    """SWE-bench versions are strings ("3.0"); a number read from JSON is written back so."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.1f}" if isinstance(value, float) and value == int(value) else str(value)
    raise _fail("version", f"must be a string, got {type(value).__name__}", where)


def _commands(record: Mapping[str, Any], field: str, where: str) -> tuple[str, ...] | None:
    value = record.get(field)
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list | tuple) or not all(isinstance(c, str) for c in value):
        raise _fail(field, "must be a list of shell commands", where)
    return tuple(value)


def _how_to_test(record: Mapping[str, Any], values: dict[str, Any], where: str) -> dict:
    """test_cmd, log_parser, pre_install, eval_commands: the record's, else the official
    harness's for a repository and version it knows, else Undertow's defaults."""
    given = {
        "test_cmd": _optional_text(record, "test_cmd", None, where),
        "log_parser": _optional_text(record, "log_parser", None, where),
        **{field: _commands(record, field, where) for field in _COMMAND_FIELDS},
    }
    unnamed = given["test_cmd"] is None and given["log_parser"] is None
    if unnamed and swebench_harness.knows(values["repo"], values["version"]):
        spec = swebench_harness.official_spec(values["repo"], values["version"],
                                              values["test_patch"])
        official = {"test_cmd": spec.test_cmd, "log_parser": swebench_harness.SWEBENCH_PARSER,
                    "pre_install": spec.pre_install, "eval_commands": spec.eval_commands}
        return {key: official[key] if value is None else value for key, value in given.items()}
    defaults = {"test_cmd": DEFAULT_TEST_CMD, "log_parser": "pytest", "pre_install": (),
                "eval_commands": ()}
    return {key: defaults[key] if value is None else value for key, value in given.items()}


def _source_dir(record: Mapping[str, Any], values: dict[str, Any], base_dir: Path | None,
                where: str) -> Path | None:
    """Where a task without an image ships its source: `source_dir`, else `repos/<repo name>`."""
    raw = _optional_text(record, "source_dir", None, where)
    if values["image"] is not None and raw is None:
        return None
    if raw is None:
        raw = f"repos/{values['repo'].rsplit('/', 1)[-1]}"
    path = Path(raw)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path


def parse_tasks(records: Iterable[tuple[str, Any]], base_dir: Path | None) -> list[Task]:
    """Parses (where, record) pairs; instance IDs must be unique."""
    tasks, seen = [], {}
    for where, record in records:
        task = parse_task(record, where, base_dir)
        if task.instance_id in seen:
            raise TaskFormatError(
                f"{where}: instance_id {task.instance_id!r} repeats {seen[task.instance_id]}")
        seen[task.instance_id] = where
        tasks.append(task)
    return tasks


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise TaskFormatError(f"{path} line {number}: not valid JSON ({error})") from None
            yield f"{path} line {number}", record


def _dataset_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise TaskFormatError(
            f"{path} looks like a Hugging Face dataset; install the optional extra "
            "(pip install 'undertow[datasets]') or convert it to JSONL") from None
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
    else:
        files = sorted(str(file) for file in path.rglob("*") if file.suffix in _DATA_SUFFIXES)
        if path.is_file():
            files = [str(path)]
        if not files:
            raise TaskFormatError(f"{path}: no tasks.jsonl, saved dataset, parquet or JSON files")
        kind = "parquet" if files[0].endswith(".parquet") else "json"
        loaded = datasets.load_dataset(kind, data_files=files, split="train")
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, dataset in splits:
        for number, record in enumerate(dataset):
            yield f"{path}{f'[{split}]' if split else ''} row {number}", record


_DATA_SUFFIXES = {".parquet", ".json", ".jsonl"}


def read_records(path: Path | str) -> tuple[Iterator[tuple[str, Any]], Path]:
    """The (where, record) pairs at `path` (JSONL file, folder with tasks.jsonl, or local HF
    dataset), and the folder that relative paths in them are relative to."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no task file or folder at {path}")
    if path.is_dir() and (path / "tasks.jsonl").exists():
        path = path / "tasks.jsonl"
    if path.is_file() and path.suffix in {".jsonl", ".json"} and path.name != "dataset_info.json":
        return _jsonl_records(path), path.parent
    return _dataset_records(path), path if path.is_dir() else path.parent


def load_tasks(path: Path | str) -> list[Task]:
    """Loads every task at `path` (JSONL file, folder with tasks.jsonl, or local HF dataset)."""
    records, base_dir = read_records(path)
    return parse_tasks(records, base_dir)


def with_base_commit(task: Task, base_commit: str) -> Task:
    """The same task with its base commit set (used when stamping a bundled set)."""
    return replace(task, base_commit=base_commit)


def task_record(task: Task, base_dir: Path | None = None) -> dict[str, Any]:
    """The task as a JSON-ready dict (source_dir relative to `base_dir` when possible)."""
    record: dict[str, Any] = {field.name: getattr(task, field.name) for field in fields(Task)}
    for field in (*_LIST_FIELDS, *_RECORD_COMMAND_FIELDS):
        record[field] = list(getattr(task, field))
    source = task.source_dir
    if source is not None and base_dir is not None and source.is_relative_to(base_dir):
        source = source.relative_to(base_dir)
    record["source_dir"] = None if source is None else str(source)
    return record
