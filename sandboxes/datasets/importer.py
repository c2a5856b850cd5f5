"""`undertow tasks import NAME --from DIR --out DIR`: a dataset's rows in, a task set out;
what each row gets, and where it is written: docs/sandboxes.md#datasets.
"""

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from undertow.sandboxes.datasets.formats import DatasetFormat, get_format, image_fields
from undertow.sandboxes.errors import DroppedRow, TaskFormatError
from undertow.sandboxes.task import Task, parse_task, read_records, task_record

# The official harness's time limit of an instance's tests (run_evaluation --timeout).
TESTS_TIMEOUT_S = 1800.0
# Undertow's own task fields, which the datasets' converters do not read: a row that gives
# one keeps it.
ROW_FIELDS = ("image", "source_dir", "workdir", "timeout_s")


@dataclass(frozen=True)
class ImportReport:
    """What an import did: `num_rows` read, `num_kept` written to `out_path`, and the
    dropped rows counted by reason (with the first row of each reason in `examples`)."""

    dataset: str
    num_rows: int
    num_kept: int
    dropped: dict[str, int]
    out_path: Path
    examples: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"{self.dataset}: kept {self.num_kept} of {self.num_rows} rows -> "
                 f"{self.out_path}"]
        if self.dropped:
            lines.append(f"dropped {self.num_rows - self.num_kept}:")
            lines += [f"  {count} {reason} (e.g. {self.examples[reason]})"
                      for reason, count in sorted(self.dropped.items(), key=lambda i: -i[1])]
        return "\n".join(lines)


def image_name(record: Mapping[str, Any], dataset: DatasetFormat, image_template: str | None,
               registry: str | None) -> str | None:
    """The task's image: the row's own unless a template is forced, else the dataset's;
    None for a row over a local repository (`source_dir`) that names none."""
    image = record.get("image")
    if not image and record.get("source_dir") and not image_template:
        return None
    if image_template or not image:
        template = image_template or dataset.image_template
        try:
            image = template.format(**image_fields(record))
        except KeyError as error:
            raise ValueError(f"image template {template!r} uses {error}, which is not one of "
                             f"{sorted(image_fields(record))}") from None
    return f"{registry.rstrip('/')}/{image}" if registry else image


def _with_row_fields(record: dict[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """`record` with the `ROW_FIELDS` that `row` gives and the conversion left unset."""
    for name in ROW_FIELDS:
        if record.get(name) in (None, "") and row.get(name) not in (None, ""):
            record[name] = row[name]
    return record


def convert_rows(dataset: DatasetFormat, rows: Iterable[tuple[str, Any]],
                 image_template: str | None = None, registry: str | None = None,
                 base_dir: Path | None = None,
                 ) -> tuple[list[Task], Counter, dict[str, str], int]:
    """The tasks of the rows that convert and load (a relative `source_dir` is taken
    from `base_dir`); the others counted by reason."""
    tasks, dropped, examples, seen = [], Counter(), {}, set()
    num_rows = 0
    for where, row in rows:
        num_rows += 1
        try:
            record = _with_row_fields(dataset.convert(row), row)
            record["image"] = image_name(record, dataset, image_template, registry)
            record.setdefault("timeout_s", TESTS_TIMEOUT_S)
            if record["instance_id"] in seen:
                raise DroppedRow("repeats an earlier instance_id")
            task = parse_task(record, where, base_dir)
        except (DroppedRow, TaskFormatError) as error:
            reason = str(error) if isinstance(error, DroppedRow) else (
                "malformed: " + str(error).rsplit(": ", 1)[-1])
            dropped[reason] += 1
            examples.setdefault(reason, where)
            continue
        seen.add(task.instance_id)
        tasks.append(task)
    return tasks, dropped, examples, num_rows


def import_dataset(name: str, source: Path, out_dir: Path, *, image_template: str | None = None,
                   registry: str | None = None) -> ImportReport:
    """Imports the rows at `source` as dataset `name`; writes `out_dir/tasks.jsonl`."""
    dataset = get_format(name)
    rows, base_dir = read_records(source)
    tasks, dropped, examples, num_rows = convert_rows(dataset, rows, image_template, registry,
                                                      base_dir.resolve())
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "tasks.jsonl"
    with out_path.open("w", encoding="utf-8") as out:
        for task in tasks:
            record = task_record(task, out_dir.resolve())
            if record["source_dir"] is None:
                del record["source_dir"]
            out.write(json.dumps({**record, "dataset": dataset.name}, ensure_ascii=False) + "\n")
    return ImportReport(dataset.name, num_rows, len(tasks), dict(dropped), out_path, examples)
