"""`undertow trees repair STORE`: mend a tree store whose log is damaged in the middle.

The gateway refuses to start on such a store and names the file and line; this keeps
every record before the damage, moves the rest aside to `STORE/damaged/`, and reports
the calls and sessions lost (`gateway/front/trees_cli.py`). Exit status 0 whether or not
anything was damaged; the report says which.
"""

from __future__ import annotations

from pathlib import Path

from undertow.commands import subcommands_of


def add(commands) -> None:
    repair = subcommands_of(commands, "trees").add_parser(
        "repair", help="keep a damaged log's records before the damage, move the rest aside")
    repair.add_argument("store", type=Path, help="tree store directory")
    repair.set_defaults(handler=_repair)


def _repair(args) -> int:
    from undertow.gateway.front.trees_cli import repair

    print(repair(args.store))
    return 0
