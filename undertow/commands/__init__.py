"""Command groups of the `undertow` command line that live in their own module.

Each module here exposes `add(commands)`, which declares its sub-commands on the
argparse sub-parsers object and sets a `handler` for each; `undertow/cli.py`
lists the modules in `COMMAND_MODULES`. Handlers import what they need only when
they run, so that `undertow --help` stays fast and never imports torch.
"""
