"""`undertow tasks validate|stamp|import`: SWE task sets, checked, stamped and imported.

`validate` and `stamp` are `sandboxes/commands.py`'s; `import` turns a dataset's rows into
a task set (`sandboxes/datasets/`): what it keeps and prints is in docs/commands.md.
"""

import argparse
from pathlib import Path

from undertow.commands import Commands, docker_url_from_env


def add(commands: Commands) -> None:
    tasks = commands.add_parser("tasks", help="SWE task sets").add_subparsers(
        dest="action", required=True)
    validate = tasks.add_parser("validate", help="check that each task's tests decide its fix")
    validate.add_argument("dir", type=Path, help="folder holding tasks.jsonl (or a dataset)")
    validate.add_argument("--runs", type=int, default=3, help="runs per task, to catch flakes")
    validate.add_argument("--concurrency", type=int, default=2)
    validate.add_argument("--task", action="append", default=None, help="only this instance_id")
    validate.set_defaults(handler=_validate)
    stamp = tasks.add_parser("stamp", help="compute and write base_commit of a shipped task set")
    stamp.add_argument("dir", type=Path, help="folder holding tasks.jsonl and repos/")
    stamp.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    stamp.set_defaults(handler=_stamp)
    _add_import(tasks)


def _add_import(tasks: Commands) -> None:
    command = tasks.add_parser(
        "import", help="turn a SWE dataset's rows (local JSONL, parquet or HF folder) into a "
        "task set")
    command.add_argument("name", help="swe-bench, swe-bench-lite, swe-bench-verified, "
                         "swe-bench-multilingual, swe-gym, swe-smith, r2e-gym, swe-rebench")
    command.add_argument("--from", dest="source", type=Path, required=True,
                         help="the rows: a JSONL file, or a folder (JSONL, parquet, save_to_disk)")
    command.add_argument("--out", type=Path, required=True, help="task set folder to write")
    command.add_argument("--image-template", default=None,
                         help="image name, e.g. 'mirror/sweb.eval.{instance_id_1776}:latest' "
                         "(placeholders: instance_id, instance_id_lower, instance_id_1776, "
                         "instance_id_s, repo, repo_owner, repo_name, repo_name_1776, "
                         "base_commit, base_commit_short, version)")
    command.add_argument("--registry", default=None,
                         help="prefix every image with this registry (a private mirror)")
    command.add_argument("--check-images", action="store_true",
                         help="list the images this Docker host lacks, and how to get each")
    command.set_defaults(handler=_import)


def _validate(args: argparse.Namespace) -> int:
    from undertow.sandboxes import commands

    return commands.validate(docker_url_from_env(), args.dir, args.runs, args.concurrency,
                             args.task)


def _stamp(args: argparse.Namespace) -> int:
    from undertow.sandboxes import commands

    return commands.stamp(args.dir, args.check)


def _import(args: argparse.Namespace) -> int:
    from undertow.sandboxes.datasets.importer import import_dataset

    report = import_dataset(args.name, args.source, args.out, image_template=args.image_template,
                            registry=args.registry)
    print(report.summary())
    if args.check_images:
        return _check_images(args.name, report.out_path)
    return 0 if report.num_kept else 1


def _check_images(name: str, tasks_path: Path) -> int:
    import asyncio

    from undertow.sandboxes.connection import connect
    from undertow.sandboxes.datasets.formats import get_format
    from undertow.sandboxes.datasets.images import missing_images
    from undertow.sandboxes.task import load_tasks

    tasks = load_tasks(tasks_path)
    with connect(docker_url_from_env()) as connection:
        missing = asyncio.run(missing_images(connection, tasks, get_format(name)))
    for line in missing:
        print(line)
    print(f"{len(tasks) - len(missing)}/{len(tasks)} images on this Docker host")
    return 1 if missing else 0
