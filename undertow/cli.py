"""The `undertow` command line.

Each command group has its own `_add_<group>` function that declares its
arguments, and a handler that imports the part it needs only when it runs, so
that `undertow --help` stays fast and never imports torch. Environment
variables are read here and nowhere else.
"""

import argparse
import sys
from pathlib import Path


def _add_model(commands) -> None:
    model = commands.add_parser("model", help="build model directories").add_subparsers(
        dest="action", required=True)
    init = model.add_parser("init", help="write a Hugging Face model directory, offline")
    init.add_argument("--out", type=Path, required=True, help="directory to write")
    init.add_argument("--size", choices=("tiny", "small"), default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(handler=_model_init)


def _model_init(args) -> int:
    from undertow.learner.modeldir import init_model_dir

    path = init_model_dir(args.out, size=args.size, seed=args.seed)
    print(path)
    return 0


def _add_engine(commands) -> None:
    engine = commands.add_parser("engine", help="the built-in inference engine").add_subparsers(
        dest="action", required=True)
    serve = engine.add_parser("serve", help="serve a model through SGLang's native API")
    serve.add_argument("--model", type=Path, required=True, help="model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port and prints it")
    serve.add_argument("--max-running-requests", type=int, default=64)
    serve.add_argument("--cache-bytes", type=int, default=256 * 2**20,
                       help="bound of the prefix cache's KV memory")
    serve.add_argument("--weight-version", default="0")
    serve.set_defaults(handler=_engine_serve)


def _engine_serve(args) -> int:
    from undertow.gateway.engines.builtin.server import EngineConfig, serve

    config = EngineConfig(
        model_dir=args.model, host=args.host, port=args.port,
        max_running_requests=args.max_running_requests, cache_bytes=args.cache_bytes,
        weight_version=args.weight_version)
    serve(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="undertow", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_model, _add_engine):
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"undertow: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
