"""`undertow trees show|stats|repair STORE`: read, measure and mend a gateway's tree store.

The work is `gateway/front/trees_cli.py`'s; the store and its damaged groups are
described in docs/design.md and docs/api.md ("undertow trees repair").
"""

import argparse
from pathlib import Path

from undertow.commands import Commands


def add(commands: Commands) -> None:
    trees = commands.add_parser("trees", help="inspect a gateway's tree store").add_subparsers(
        dest="action", required=True)
    show = trees.add_parser("show", help="print trees: spans, branch points, trainable tokens")
    show.add_argument("store", type=Path, help="tree store directory")
    show.add_argument("--group", default=None)
    show.add_argument("--session", default=None)
    show.add_argument("--max-tokens", type=int, default=12,
                      help="tokens of each span to print at its start and end")
    show.set_defaults(handler=_show)
    stats = trees.add_parser("stats", help="unique tokens vs a per-call log")
    stats.add_argument("store", type=Path, help="tree store directory")
    stats.set_defaults(handler=_stats)
    repair = trees.add_parser(
        "repair", help="keep every record of a damaged log that still replays, move the rest aside")
    repair.add_argument("store", type=Path, help="tree store directory")
    repair.set_defaults(handler=_repair)


def _show(args: argparse.Namespace) -> int:
    from undertow.gateway.front.trees_cli import show

    print(show(args.store, group=args.group, session=args.session, max_tokens=args.max_tokens))
    return 0


def _stats(args: argparse.Namespace) -> int:
    from undertow.gateway.front.trees_cli import stats

    print(stats(args.store))
    return 0


def _repair(args: argparse.Namespace) -> int:
    from undertow.gateway.front.trees_cli import repair

    print(repair(args.store))
    return 0
