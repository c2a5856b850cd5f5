"""`undertow serve`: the built-in engine (or given engines) and the gateway, in one command.

The first of the three commands that point an agent at Undertow (README, "Use it with
your agent"): it starts what `undertow rollout` embeds (`undertow/run/embedded.py`) and
serves until Ctrl-C or SIGTERM; what it prints is in docs/commands.md. The
`--auto-sessions` options it shares with `undertow gateway serve` are declared here.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from undertow.commands import ADMIN_TOKEN_VARIABLE, Commands, admin_token_from_env

if TYPE_CHECKING:
    from undertow.gateway.front.config import AutoSessionsConfig
    from undertow.run.embedded import EmbeddedGateway

DEFAULT_STORE = Path("runs/serve/store")


def add(commands: Commands) -> None:
    serve = commands.add_parser(
        "serve", help="the built-in engine (or --engine URLs) and the gateway, in one command",
        description="Serve a model behind the gateway; point any agent at the URL it prints. "
        f"The admin token is ${ADMIN_TOKEN_VARIABLE}, or a fresh one (printed) when unset.")
    serve.add_argument("--model", type=Path, required=True, help="model directory")
    serve.add_argument("--engine", action="append", default=[], metavar="URL",
                       help="use this engine (repeat for several) instead of starting the "
                       "built-in one on --model")
    serve.add_argument("--store", type=Path, default=DEFAULT_STORE,
                       help=f"tree store directory (default: {DEFAULT_STORE})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port and prints it")
    serve.add_argument("--model-name", default="undertow", help="name listed by /v1/models")
    add_auto_session_arguments(serve)
    serve.set_defaults(handler=_serve)


def add_auto_session_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auto-sessions", default=None, metavar="GROUP",
                        help="an API key the gateway does not know opens a session in GROUP "
                        "on first use (one per key), so a tool needs only the URL and any key")
    parser.add_argument("--idle-close-s", type=float, default=1800.0, metavar="SECONDS",
                        help="with --auto-sessions: close a session idle this long, without "
                        "a reward (default: 1800)")
    parser.add_argument("--reopen", default="expired", metavar="POLICY",
                        help="with --auto-sessions: what a closed session's key opens on its "
                        "next call: 'expired' (default): a new session of its group when it "
                        "closed for idleness, a 401 when closed with a reward; 'closed': a "
                        "new session either way; 'never': a 401 either way")


def auto_sessions_config(args: argparse.Namespace) -> AutoSessionsConfig | None:
    """The gateway's `AutoSessionsConfig` from the options, or None when off."""
    if args.auto_sessions is None:
        return None
    from undertow.gateway.front.config import AutoSessionsConfig

    return AutoSessionsConfig(group=args.auto_sessions, idle_close_s=args.idle_close_s,
                              check_interval_s=min(10.0, args.idle_close_s / 4),
                              reopen=args.reopen)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from undertow.gateway.front.app import event_loop_factory, tune_gc, tune_malloc

    token = admin_token_from_env()
    tune_gc()
    tune_malloc()
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(_serve_until_stopped(args, token))
    return 0


async def _serve_until_stopped(args: argparse.Namespace, token: str) -> None:
    import asyncio
    import signal

    from undertow.run.embedded import embedded_gateway

    args.store.mkdir(parents=True, exist_ok=True)  # its parent holds the engine's log
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)
    async with embedded_gateway(args.model, args.store, tuple(args.engine), admin_token=token,
                                host=args.host, port=args.port, model_name=args.model_name,
                                auto_sessions=auto_sessions_config(args)) as gateway:
        print(banner(gateway, args, token_was_set=bool(token)), flush=True)
        await stop.wait()
        print("undertow serve: stopping", flush=True)


def banner(gateway: EmbeddedGateway, args: argparse.Namespace, token_was_set: bool) -> str:
    """What `undertow serve` prints once it serves: URL, store, admin token, next step."""
    engine = ("built-in, on " + str(args.model) + "; log "
              + str(Path(args.store).parent / "engine.log") if not args.engine else "given")
    token_line = (f"{ADMIN_TOKEN_VARIABLE} (from your environment)" if token_was_set else
                  f"export {ADMIN_TOKEN_VARIABLE}={shlex.quote(gateway.admin_token)}"
                  "   # paste it where you run `undertow session`")
    lines = [f"gateway  {gateway.url}",
             f"engine   {' '.join(gateway.engine_urls)} ({engine})",
             f"store    {args.store}   (undertow trees show {shlex.quote(str(args.store))})",
             f"admin    {token_line}"]
    config = auto_sessions_config(args)
    if config is not None:
        lines.append(f"auto     {config.describe()}")
        lines.append(f"next     OPENAI_BASE_URL={gateway.url}/v1 OPENAI_API_KEY=any-key "
                     "your-agent   (or ANTHROPIC_BASE_URL=" + gateway.url + ")")
    else:
        lines.append(f"next     eval \"$(undertow session open --gateway {gateway.url} "
                     "--group my-task)\"   then run your agent in that shell")
    return "\n".join(lines)
