"""Command groups of the `undertow` command line that live in their own module.

Each module here exposes `add(commands)`, which declares its sub-commands on the
argparse sub-parsers object and sets a `handler` for each; `undertow/cli.py`
lists the modules in `COMMAND_MODULES`. Handlers import what they need only when
they run, so that `undertow --help` stays fast and never imports torch.
"""

import argparse


def subcommands_of(commands, name: str) -> argparse._SubParsersAction:
    """The sub-parsers of the existing command group `name` (e.g. `trees`, declared in
    `undertow/cli.py`), so that a module can add a sub-command to a group it does not
    own. argparse offers no public way to reach them; this is the one place that looks."""
    group = commands.choices[name]
    return next(action for action in group._actions
                if isinstance(action, argparse._SubParsersAction))
