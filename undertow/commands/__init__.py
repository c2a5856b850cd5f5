"""The command groups of the `undertow` command line, one module each (docs/commands.md).

Each module's `add(commands)` declares its group's commands, arguments and handlers;
`undertow/cli.py` holds the one list of groups. A handler imports what it needs only when
it runs, so that importing these modules (`undertow --help`) stays fast and never loads
torch. The command line reads the environment here and passes the values on (STYLE.md).
"""

import argparse
import os
from typing import Protocol

ADMIN_TOKEN_VARIABLE = "UNDERTOW_ADMIN_TOKEN"


class Commands(Protocol):
    """The argparse sub-parsers object a group adds its commands to: what
    `ArgumentParser.add_subparsers()` returns, of which a group uses `add_parser` only."""

    def add_parser(self, name: str, *, help: str | None = ..., description: str | None = ...,
                   add_help: bool = ...) -> argparse.ArgumentParser: ...


class CommandGroup(Protocol):
    """A module of this package: `add` declares the group on the command line."""

    __name__: str

    def add(self, commands: Commands) -> None: ...


def docker_url_from_env() -> str | None:
    """The Docker daemon `DOCKER_HOST` names; None: the local socket."""
    return os.environ.get("DOCKER_HOST")


def admin_token_from_env() -> str:
    """The gateway's admin token from `UNDERTOW_ADMIN_TOKEN`; empty when unset."""
    return os.environ.get(ADMIN_TOKEN_VARIABLE, "")
