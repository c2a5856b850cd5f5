"""`undertow sandbox build-base|gc`: the sandboxes' base image, and containers left behind.

Both run `sandboxes/commands.py` against the Docker daemon of `DOCKER_HOST` (or the local
socket); the sandboxes themselves are described in docs/design.md.
"""

import argparse
from pathlib import Path

from undertow.commands import Commands, docker_url_from_env


def add(commands: Commands) -> None:
    sandbox = commands.add_parser("sandbox", help="Docker sandboxes").add_subparsers(
        dest="action", required=True)
    base = sandbox.add_parser("build-base", help="build the base image offline (Debian packages)")
    base.add_argument("--mirror", default=None, help="Debian mirror (default: the host apt's)")
    base.add_argument("--cache-dir", type=Path, default=None,
                      help="where the root file system tarball is cached")
    base.set_defaults(handler=_build_base)
    gc = sandbox.add_parser("gc", help="remove sandbox containers left by crashed runs")
    gc.add_argument("--run", default=None, help="only this run's containers (default: all)")
    gc.add_argument("--orphans-only", action="store_true",
                    help="keep containers whose starting process is still alive")
    gc.add_argument("--docker-host", action="append", default=[], metavar="URL",
                    help="a Docker daemon to clear (repeat for each of a run's "
                         "sandbox.docker_hosts; default: DOCKER_HOST or the local socket)")
    gc.set_defaults(handler=_gc)


def _build_base(args: argparse.Namespace) -> int:
    from undertow.sandboxes import commands

    return commands.build_base(docker_url_from_env(), args.mirror, args.cache_dir)


def _gc(args: argparse.Namespace) -> int:
    from undertow.sandboxes import commands

    urls = args.docker_host or [docker_url_from_env()]
    return commands.collect_garbage(urls, args.run, args.orphans_only)
