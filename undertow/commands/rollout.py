"""`undertow rollout`: a scaffold on tasks through the gateway; grade and reward sessions.

Its configuration is `RolloutCommand` (`undertow/run/rollout.py`), given as `-c FILE` and
`KEY=VALUE` overrides (`undertow/config.py`); the flags are the tasks, scaffold, the gateway
or model and engines, and the output folder. The old flags of the other keys (`ALIASES`,
and `-o KEY=VALUE` for `scaffold_options.KEY`) still work, hidden, for scripts not yet moved.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.commands import ADMIN_TOKEN_VARIABLE, Commands
from undertow.config import Aliases, add_alias_flags, add_config_arguments, command_config

if TYPE_CHECKING:
    from undertow.run.rollout import RolloutCommand

# Deprecated flag: (argparse keyword arguments, the config key it sets).
ALIASES: Aliases = {
    "--group-size": ({"type": int}, "group_size"),
    "--concurrency": ({"type": int}, "concurrency"),
    "--timeout-s": ({"type": float}, "timeout_s"),
    "--task": ({"action": "append"}, "instance_ids"),
    "--num-tasks": ({"type": int}, "num_tasks"),
    "--timeout-value": ({}, "timeout_value"),
    "--progress-interval-s": ({"type": float}, "progress_interval_s"),
}
FLAG_KEYS = frozenset({"tasks", "scaffold", "gateway_url", "model_dir", "engine_urls",
                       "out_dir", "admin_token", "docker_url"})


def add(commands: Commands) -> None:
    rollout = commands.add_parser(
        "rollout", help="run a scaffold on tasks through the gateway, grade and reward sessions",
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    rollout.add_argument("--tasks", type=Path, required=True,
                         help="tasks.jsonl, a folder holding one, or a local dataset")
    rollout.add_argument("--scaffold", required=True,
                         help="mini-swe-agent, command, claude-code, codex, swe-agent, openhands")
    rollout.add_argument("--gateway", default=None, metavar="URL",
                         help=f"a running gateway (admin token from {ADMIN_TOKEN_VARIABLE}); "
                         "default: engine and gateway embedded for this run")
    rollout.add_argument("--model", type=Path, default=None,
                         help="embedded: model directory (default: the tiny model, built once)")
    rollout.add_argument("--engine", action="append", default=[], metavar="URL",
                         help="embedded: use these engines instead of starting the built-in one")
    rollout.add_argument("--out", type=Path, default=None, help="default runs/rollouts")
    add_config_arguments(rollout, _config_class, exclude=FLAG_KEYS)
    add_alias_flags(rollout, ALIASES)
    rollout.add_argument("-o", "--option", action="append", default=[], help=argparse.SUPPRESS)
    rollout.set_defaults(handler=_rollout)


def _config_class() -> type[RolloutCommand]:
    from undertow.run.rollout import RolloutCommand

    return RolloutCommand


def rollout_command(args: argparse.Namespace,
                    environ: Mapping[str, str] = os.environ) -> RolloutCommand:
    """The `RolloutCommand` of the parsed command line (`environ`: where the admin token
    and `DOCKER_HOST` are read)."""
    flags = {"tasks": args.tasks, "scaffold": args.scaffold, "gateway_url": args.gateway,
             "model_dir": args.model, "engine_urls": tuple(args.engine) or None,
             "out_dir": args.out, "admin_token": environ.get(ADMIN_TOKEN_VARIABLE, ""),
             "docker_url": environ.get("DOCKER_HOST")}
    overrides = [*_option_overrides(args.option), *args.overrides]
    args = _with(args, overrides=overrides)
    return command_config(_config_class(), args, "rollout", flags, ALIASES)


def _option_overrides(options: list[str]) -> list[str]:
    """`-o KEY=VALUE` (deprecated) as `scaffold_options.KEY=VALUE`; `command` stays text."""
    overrides = []
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--option {option!r} is not KEY=VALUE")
        if key == "command":   # a shell command line, never YAML
            value = "'" + value.replace("'", "''") + "'"
        overrides.append(f"scaffold_options.{key}={value}")
    return overrides


def _with(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _rollout(args: argparse.Namespace) -> int:
    from undertow.run.rollout import main

    return main(rollout_command(args))
