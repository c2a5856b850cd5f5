"""`undertow engine serve`: the built-in inference engine, speaking SGLang's native API.

Its configuration is `EngineConfig` (`gateway/builtin_engine/server.py`), given as `-c FILE`
and `KEY=VALUE` overrides (`undertow/config.py`); the flags are the model directory, host
and port. The old flags of the other keys (`ALIASES`) still work, hidden, for old scripts:
Undertow's own launcher (`gateway/engines/launch.py`) passes `KEY=VALUE`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.commands import Commands
from undertow.config import Aliases, add_alias_flags, add_config_arguments, command_config

if TYPE_CHECKING:
    from undertow.gateway.builtin_engine.server import EngineConfig

# Deprecated flag: (argparse keyword arguments, the config key it sets).
ALIASES: Aliases = {
    "--max-running-requests": ({"type": int}, "max_running_requests"),
    "--cache-bytes": ({"type": int}, "cache_bytes"),
    "--weight-version": ({}, "weight_version"),
    "--num-threads": ({"type": int}, "num_threads"),
    "--incremental-streaming-output": ({"action": "store_const", "const": True},
                                       "incremental_streaming_output"),
    "--chunked-prefill-size": ({"type": int}, "chunked_prefill_size"),
    "--device": ({}, "device"),
    "--dtype": ({}, "dtype"),
}
FLAG_KEYS = frozenset({"model_dir", "host", "port"})


def add(commands: Commands) -> None:
    engine = commands.add_parser("engine", help="the built-in inference engine").add_subparsers(
        dest="action", required=True)
    serve = engine.add_parser("serve", help="serve a model through SGLang's native API",
                              add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model", type=Path, required=True, help="model directory")
    serve.add_argument("--host", default=None, help="default 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default 0: a free port, printed")
    add_config_arguments(serve, _config_class, exclude=FLAG_KEYS)
    add_alias_flags(serve, ALIASES)
    serve.set_defaults(handler=_serve)


def _config_class() -> type[EngineConfig]:
    from undertow.gateway.builtin_engine.server import EngineConfig

    return EngineConfig


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of the parsed command line."""
    flags = {"model_dir": args.model, "host": args.host, "port": args.port}
    return command_config(_config_class(), args, "engine", flags, ALIASES)


def _serve(args: argparse.Namespace) -> int:
    from undertow.gateway.builtin_engine.server import serve

    serve(engine_config(args))
    return 0
