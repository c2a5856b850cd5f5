"""`undertow ui`: the run viewer in the browser (`undertow/ui/`).

    undertow ui --runs runs/ [--store STORE] [--gateway URL] [--port N]

`--runs` is one run directory or a folder of them; `--store` adds a gateway's tree
store that is not in a run; `--gateway` turns on the live view of its open sessions,
with the admin token read from UNDERTOW_ADMIN_TOKEN (never from the command line, so
that it shows in no process list, and never sent to the browser).
"""

import os
from pathlib import Path


def add(commands) -> None:
    ui = commands.add_parser("ui", help="browse runs, steps, sessions and trees in a browser")
    ui.add_argument("--runs", type=Path, required=True,
                    help="a run directory, or a folder holding run directories")
    ui.add_argument("--store", type=Path, default=None,
                    help="a tree store (gateway --store) to show besides the runs")
    ui.add_argument("--gateway", default=None,
                    help="URL of a live gateway (admin token in UNDERTOW_ADMIN_TOKEN)")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=0, help="0 picks a free port and prints it")
    ui.set_defaults(handler=_ui)


def _ui(args) -> int:
    import asyncio
    import contextlib

    from undertow.ui.server import ViewerConfig, serve

    config = ViewerConfig(runs_dir=args.runs, store_dir=args.store, gateway_url=args.gateway,
                          admin_token=os.environ.get("UNDERTOW_ADMIN_TOKEN", ""),
                          host=args.host, port=args.port)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config))
    return 0
