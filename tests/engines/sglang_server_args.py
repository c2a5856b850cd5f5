"""SGLang 0.5.23's own command-line rules, run from its wheel: `python -m
tests.engines.sglang_server_args WHEEL` reads a JSON list of `sglang.launch_server` argument
lists on stdin and writes, for each, what SGLang makes of it, as one JSON list on stdout.

Each argument list goes through the parser `sglang.launch_server` builds
(`ServerArgs.add_cli_args`, `srt/server_args.py`: an unknown flag or a value outside a
flag's choices is an error; the HiCache fields are given back as parsed) and then the
override rule for deterministic inference
(`_deterministic_attention_backend`, `srt/arg_groups/overrides.py`), which refuses an
attention backend outside `DETERMINISTIC_ATTENTION_BACKEND_CHOICES`, after the CPU
platform's default backend (`X86_CPU_ATTENTION_BACKEND`). The rest of SGLang's
resolution loads the model's config through its multimodal stack (torchvision and more),
which is not installed here, so it is not run.

The modules are imported from the wheel itself (zipimport), in a process of their own:
`sglang`'s and `sglang.srt`'s package `__init__` files (which import the whole runtime) are
replaced by bare packages, and the two libraries the import chain touches but never calls
here (`pybase64`, `zmq`) by empty modules; nothing of this reaches the test process.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from importlib import import_module

NOT_INSTALLED = ("pybase64", "zmq", "zmq.auth", "zmq.auth.thread")
# The backend SGLang gives `--device cpu` without `--attention-backend` on an x86 host, before
# the override runs (`srt/arg_groups/platform_hook.py`, `handle_cpu_backends`; a resolution
# step whose bookkeeping needs the whole pipeline, so its rule is applied here by hand).
X86_CPU_ATTENTION_BACKEND = "intel_amx"
# The fields of a HiCache shared-storage launch (`SGLangLauncher.kv_share_dir`), as parsed.
HICACHE_FIELDS = ("enable_hierarchical_cache", "hicache_write_policy", "hicache_storage_backend",
                  "file_storage_path", "hicache_storage_backend_extra_config",
                  "hicache_storage_prefetch_policy", "page_size", "served_model_name")


class _Absent(types.ModuleType):
    """A library the import chain names but the parser never calls."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def load(wheel: str) -> tuple[types.ModuleType, types.ModuleType]:
    """SGLang's `server_args` and `arg_groups.overrides` modules, from the wheel."""
    for name, folder in (("sglang", "sglang"), ("sglang.srt", "sglang/srt")):
        package = types.ModuleType(name)
        package.__path__ = [f"{wheel}/{folder}"]
        sys.modules[name] = package
    for name in NOT_INSTALLED:
        module = _Absent(name)
        module.__path__ = []
        sys.modules[name] = module
    return (import_module("sglang.srt.server_args"),
            import_module("sglang.srt.arg_groups.overrides"))


def judge(server_args: types.ModuleType, overrides: types.ModuleType, argv: list[str]) -> dict:
    """What SGLang makes of `argv`: parsed (device, attention backend, deterministic) or
    the error it stops with."""
    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    server_args.ServerArgs.add_cli_args(parser)
    try:
        parsed, unknown = parser.parse_known_args(argv)
        if unknown:
            raise ValueError(f"unrecognized arguments: {' '.join(unknown)}")
        if parsed.device == "cpu" and parsed.attention_backend is None:
            parsed.attention_backend = X86_CPU_ATTENTION_BACKEND
        overrides._deterministic_attention_backend(parsed)
    except (argparse.ArgumentError, ValueError) as error:
        return {"error": str(error)}
    return {"error": None, "device": parsed.device, "attention_backend": parsed.attention_backend,
            "enable_deterministic_inference": parsed.enable_deterministic_inference,
            "weight_version": parsed.weight_version,
            "hicache": {name: getattr(parsed, name) for name in HICACHE_FIELDS}}


def main() -> None:
    server_args, overrides = load(sys.argv[1])
    commands = json.load(sys.stdin)
    json.dump({"deterministic_backends": list(server_args.DETERMINISTIC_ATTENTION_BACKEND_CHOICES),
               "results": [judge(server_args, overrides, argv) for argv in commands]},
              sys.stdout)


if __name__ == "__main__":
    main()
