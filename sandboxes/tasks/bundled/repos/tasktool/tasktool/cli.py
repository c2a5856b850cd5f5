"""The ``tasktool`` command line: argument parsing and one handler per command.

``main(argv, out, env)`` is the whole program; it returns the exit status and
writes only to ``out``, so tests call it directly.
"""

import argparse
import os
import sys
from datetime import date
from pathlib import Path
from typing import TextIO

from tasktool.dates import parse_due
from tasktool.format import render_stats, render_table
from tasktool.model import TaskError, normalize_tag
from tasktool.query import SORT_KEYS, parse_query, sort_tasks
from tasktool.storage import TaskStore


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tasktool", description="A to-do list in a JSON file.")
    parser.add_argument("--file", help="task file (default: $TASKTOOL_FILE or ~/.tasks.json)")
    parser.add_argument("--today", type=date.fromisoformat, help="act as if today were this date")
    commands = parser.add_subparsers(dest="command", required=True)

    add = commands.add_parser("add", help="add a task")
    add.add_argument("title")
    add.add_argument("--due", default="")
    add.add_argument("--priority", type=int, default=1, choices=range(1, 4))
    add.add_argument("--tag", action="append", default=[], dest="tags")

    show = commands.add_parser("list", help="list tasks matching a query")
    show.add_argument("terms", nargs="*")
    show.add_argument("--all", action="store_true", help="include finished tasks")
    show.add_argument("--sort", default="id", choices=SORT_KEYS)
    show.add_argument("--width", type=int, default=80)

    for name, help_text in [("done", "mark tasks finished"), ("remove", "delete tasks")]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("ids", type=int, nargs="+")

    tag = commands.add_parser("tag", help="add tags to a task")
    tag.add_argument("id", type=int)
    tag.add_argument("tags", nargs="+")

    edit = commands.add_parser("edit", help="change a task")
    edit.add_argument("id", type=int)
    edit.add_argument("--title")
    edit.add_argument("--due", help="new due date, or 'none' to clear it")
    edit.add_argument("--priority", type=int, choices=range(1, 4))

    commands.add_parser("stats", help="count tasks")
    return parser


def main(argv: list[str] | None = None, out: TextIO = sys.stdout,
         env: dict[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = os.environ if env is None else env
    path = args.file or env.get("TASKTOOL_FILE") or Path.home() / ".tasks.json"
    today = args.today or date.today()
    try:
        store = TaskStore(path)
        HANDLERS[args.command](store, args, today, out)
    except TaskError as error:
        print(f"tasktool: {error}", file=out)
        return 1
    return 0


def cmd_add(store: TaskStore, args, today: date, out: TextIO) -> None:
    task = store.add(args.title, priority=args.priority, due=parse_due(args.due, today),
                     tags=tuple(args.tags), created=today)
    store.save()
    print(f"added #{task.id}", file=out)


def cmd_list(store: TaskStore, args, today: date, out: TextIO) -> None:
    terms = list(args.terms) if args.all else [*args.terms, "done:no"]
    matching = filter(parse_query(terms, today), store.tasks)
    print(render_table(sort_tasks(matching, args.sort), today, width=args.width), file=out)


def cmd_done(store: TaskStore, args, today: date, out: TextIO) -> None:
    for task_id in args.ids:
        store.get(task_id).done = True
    store.save()
    print(f"done: {', '.join(f'#{task_id}' for task_id in args.ids)}", file=out)


def cmd_remove(store: TaskStore, args, today: date, out: TextIO) -> None:
    for task_id in args.ids:
        store.remove(task_id)
    store.save()
    print(f"removed: {', '.join(f'#{task_id}' for task_id in args.ids)}", file=out)


def cmd_tag(store: TaskStore, args, today: date, out: TextIO) -> None:
    task = store.get(args.id)
    for tag in args.tags:
        tag = normalize_tag(tag)
        if tag and tag not in task.tags:
            task.tags.append(tag)
    task.tags.sort()
    store.save()
    print(f"#{task.id} tags: {' '.join(task.tags)}", file=out)


def cmd_edit(store: TaskStore, args, today: date, out: TextIO) -> None:
    task = store.get(args.id)
    if args.title is not None:
        task.title = args.title.strip()
    if args.due is not None:
        task.due = parse_due(args.due, today)
    if args.priority is not None:
        task.priority = args.priority
    store.save()
    print(f"updated #{task.id}", file=out)


def cmd_stats(store: TaskStore, args, today: date, out: TextIO) -> None:
    print(render_stats(store.tasks, today), file=out)


HANDLERS = {
    "add": cmd_add,
    "list": cmd_list,
    "done": cmd_done,
    "remove": cmd_remove,
    "tag": cmd_tag,
    "edit": cmd_edit,
    "stats": cmd_stats,
}
