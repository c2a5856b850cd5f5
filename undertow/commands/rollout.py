"""`undertow rollout`: a scaffold on tasks through the gateway; grade and reward sessions.

Its configuration is `RolloutCommand` (`undertow/rollout_run.py`): `-c FILE` and
`KEY=VALUE` overrides (`undertow/config.py`), e.g. `group_size=4 concurrency=8
scaffold_options.step_limit=10`; `--help` lists the keys and their defaults. The flags
are what one types every time: tasks, scaffold, the gateway or model and engines, and
the output folder. The admin token and Docker daemon come from `UNDERTOW_ADMIN_TOKEN` and
`DOCKER_HOST`. The old flags of the other keys (`--group-size`, `-o KEY=VALUE`, ...) still
work, hidden, for scripts not yet moved.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from undertow.config import add_alias_flags, add_config_arguments, command_config

# Deprecated flag: (argparse keyword arguments, the config key it sets).
ALIASES: dict[str, tuple[dict, str]] = {
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


def add(commands) -> None:
    rollout = commands.add_parser(
        "rollout", help="run a scaffold on tasks through the gateway, grade and reward sessions",
        add_help=False)
    rollout.add_argument("--tasks", type=Path, required=True,
                         help="tasks.jsonl, a folder holding one, or a local dataset")
    rollout.add_argument("--scaffold", required=True,
                         help="mini-swe-agent, command, claude-code, codex, swe-agent, openhands")
    rollout.add_argument("--gateway", default=None, metavar="URL",
                         help="a running gateway (admin token from UNDERTOW_ADMIN_TOKEN); "
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


def _config_class():
    from undertow.rollout_run import RolloutCommand

    return RolloutCommand


def rollout_command(args, environ=os.environ):
    """The `RolloutCommand` of the parsed command line (`environ`: the two variables)."""
    flags = {"tasks": args.tasks, "scaffold": args.scaffold, "gateway_url": args.gateway,
             "model_dir": args.model, "engine_urls": tuple(args.engine) or None,
             "out_dir": args.out, "admin_token": environ.get("UNDERTOW_ADMIN_TOKEN", ""),
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


def _with(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


def _rollout(args) -> int:
    from undertow.rollout_run import main

    return main(rollout_command(args))
