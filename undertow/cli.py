"""The `undertow` command line: the one list of command groups, and `main`.

Each group is a module of `undertow/commands/` whose `add` declares its commands;
docs/commands.md lists them all. Building the parser imports those modules only, never
a command's work, so that `undertow --help` stays fast and never loads torch.
"""

import argparse
import sys

from undertow.commands import (
    CommandGroup,
    chat_eval,
    doctor,
    engine,
    export,
    gateway,
    model,
    plot,
    rollout,
    sandbox,
    serve,
    session,
    sft,
    simulate,
    tasks,
    train,
    trees,
    ui,
)
from undertow.commands import eval as eval_  # `eval` is a builtin

# In the order `undertow --help` lists them (`sft` also declares `sft-collect`).
COMMAND_GROUPS: tuple[CommandGroup, ...] = (
    model, simulate, sandbox, tasks, trees, train, sft, plot, engine, gateway, rollout, doctor,
    serve, session, ui, export, eval_, chat_eval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="undertow", description="The `undertow` command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command `argv` (default: the process's arguments) names; its exit status.
    A wrong value or a missing file ends it with one line and status 2, as argparse does."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"undertow: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
