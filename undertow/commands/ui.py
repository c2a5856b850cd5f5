"""`undertow ui`: the run viewer in the browser (`undertow/ui/`, docs/ui.md).

With `--gateway`, the live view of its open sessions uses the admin token of
`UNDERTOW_ADMIN_TOKEN`: never a flag, so that it shows in no process list, and never sent
to the browser.
"""

import argparse
from pathlib import Path

from undertow.commands import ADMIN_TOKEN_VARIABLE, Commands, admin_token_from_env


def add(commands: Commands) -> None:
    ui = commands.add_parser("ui", help="browse runs, steps, sessions and trees in a browser")
    ui.add_argument("--runs", type=Path, required=True,
                    help="a run directory, or a folder holding run directories")
    ui.add_argument("--store", type=Path, default=None,
                    help="a tree store (gateway --store) to show besides the runs")
    ui.add_argument("--gateway", default=None,
                    help=f"URL of a live gateway (admin token in {ADMIN_TOKEN_VARIABLE})")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=0, help="0 picks a free port and prints it")
    ui.set_defaults(handler=_ui)


def _ui(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from undertow.ui.server import ViewerConfig, serve

    config = ViewerConfig(runs_dir=args.runs, store_dir=args.store, gateway_url=args.gateway,
                          admin_token=admin_token_from_env(), host=args.host, port=args.port)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0
