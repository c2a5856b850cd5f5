"""`undertow trees repair STORE`: mend a tree store whose log is damaged in the middle.

The gateway sets such a group aside at start-up (a warning names the file and line;
the other groups serve); this keeps every record that still replays, moves the lines
that do not aside to `STORE/damaged/`, and reports the calls and sessions lost
(`gateway/front/trees_cli.py`); restart the gateway to serve the group again. Exit status
0 whether or not anything was damaged; the report says which.
"""

from __future__ import annotations

from pathlib import Path

from undertow.commands import subcommands_of


def add(commands) -> None:
    repair = subcommands_of(commands, "trees").add_parser(
        "repair", help="keep every record of a damaged log that still replays, move the rest aside")
    repair.add_argument("store", type=Path, help="tree store directory")
    repair.set_defaults(handler=_repair)


def _repair(args) -> int:
    from undertow.gateway.front.trees_cli import repair

    print(repair(args.store))
    return 0
