"""`undertow gateway serve`: the OpenAI/Anthropic-compatible gateway in front of engines.

Its configuration is `GatewayConfig` (`gateway/front/config.py`), given as `-c FILE` and
`KEY=VALUE` overrides (`undertow/config.py`); the flags are the engines, model directory,
store, host and port, and `--auto-sessions`, shared with `undertow serve`. The old flags of
the other keys (`ALIASES`) still work, hidden, for scripts not yet moved.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.commands import ADMIN_TOKEN_VARIABLE, Commands, admin_token_from_env
from undertow.commands.serve import add_auto_session_arguments, auto_sessions_config
from undertow.config import Aliases, add_alias_flags, add_config_arguments, command_config

if TYPE_CHECKING:
    from undertow.gateway.front.config import GatewayConfig

# Deprecated flag: (argparse keyword arguments, the config key it sets).
ALIASES: Aliases = {
    "--model-name": ({}, "model_name"),
    "--tool-parser": ({}, "tool_parser"),
    "--max-body-bytes": ({"type": int}, "max_body_bytes"),
    "--context-length": ({"type": int}, "context_length"),
    "--token-truth": ({}, "token_truth"),
    "--store-sync": ({}, "store_sync"),
    "--max-in-flight-per-engine": ({"type": int}, "router.max_in_flight_per_engine"),
    "--retry-after": ({"type": float}, "router.retry_after_s"),
}
FLAG_KEYS = frozenset({"model_dir", "store_dir", "engine_urls", "host", "port", "admin_token"})


def add(commands: Commands) -> None:
    gateway = commands.add_parser("gateway", help="the OpenAI/Anthropic-compatible gateway"
                                  ).add_subparsers(dest="action", required=True)
    serve = gateway.add_parser("serve", help="serve scaffolds, capture calls into trees "
                               f"(admin token from {ADMIN_TOKEN_VARIABLE})", add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--engine", action="append", default=[], metavar="URL",
                       help="an engine's base URL (repeat for several)")
    serve.add_argument("--model", type=Path, required=True, help="model directory")
    serve.add_argument("--store", type=Path, required=True, help="tree store directory")
    serve.add_argument("--host", default=None, help="default 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default 0: a free port, printed")
    add_auto_session_arguments(serve)
    add_config_arguments(serve, _config_class, exclude=FLAG_KEYS)
    add_alias_flags(serve, ALIASES)
    serve.set_defaults(handler=_serve)


def _config_class() -> type[GatewayConfig]:
    from undertow.gateway.front.config import GatewayConfig

    return GatewayConfig


def gateway_config(args: argparse.Namespace, admin_token: str = "") -> GatewayConfig:
    """The `GatewayConfig` of the parsed command line."""
    flags = {"model_dir": args.model, "store_dir": args.store,
             "engine_urls": tuple(args.engine) or None, "host": args.host, "port": args.port,
             "admin_token": admin_token}
    config = command_config(_config_class(), args, "gateway", flags, ALIASES)
    auto_sessions = auto_sessions_config(args)
    if auto_sessions is not None:
        config = dataclasses.replace(config, auto_sessions=auto_sessions)
    return config


def _serve(args: argparse.Namespace) -> int:
    from undertow.gateway.front.app import serve

    serve(gateway_config(args, admin_token_from_env()))
    return 0
