"""`undertow tasks import NAME --from DIR --out DIR`: a dataset's rows as a task set.

NAME is one of `sandboxes/datasets/formats.py`'s datasets (swe-bench, swe-bench-lite,
swe-bench-verified, swe-bench-multilingual, swe-gym, swe-smith, r2e-gym, swe-rebench).
Prints how many rows were kept and why the others were dropped; with `--check-images`,
also each missing image and the command that gets it (exit status 1 if any is missing).
A row over a local repository (`source_dir`, relative to the rows' folder, and no `image`)
keeps its fields: its image is built from that clone at the row's `base_commit`.
"""

from __future__ import annotations

import os
from pathlib import Path

from undertow.commands import subcommands_of


def add(commands) -> None:
    command = subcommands_of(commands, "tasks").add_parser(
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


def _import(args) -> int:
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
    with connect(os.environ.get("DOCKER_HOST")) as connection:
        missing = asyncio.run(missing_images(connection, tasks, get_format(name)))
    for line in missing:
        print(line)
    print(f"{len(tasks) - len(missing)}/{len(tasks)} images on this Docker host")
    return 1 if missing else 0
