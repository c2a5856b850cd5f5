"""A stand-in for SGLang at the outer edge of the cells' tests: run as
`sglang_standin.py RECORD -m sglang.launch_server ARGS...` (a small shell script given as
`pool.sglang_python` puts the first two in front), it parses SGLang's command line as the
`SGLangLauncher` writes it (an unknown flag is an error, as it is to SGLang), appends the
flags and `CUDA_VISIBLE_DEVICES` to RECORD as one JSON line, and becomes Undertow's built-in
engine on the model, which speaks SGLang's protocol. It proves the wiring, not SGLang."""

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", action="append", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", required=True)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--base-gpu-id", type=int, default=0)
    return parser


def main(argv: list[str]) -> None:
    record_path, module, *flags = argv
    if module != "-m" or flags[0] != "sglang.launch_server":
        sys.exit(f"sglang stand-in: expected -m sglang.launch_server, got {argv[1:3]}")
    args = _parser().parse_args(flags[1:])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if len(visible.split(",")) != args.tp_size:
        sys.exit(f"sglang stand-in: CUDA_VISIBLE_DEVICES={visible!r} is not {args.tp_size} GPUs")
    with open(record_path, "a") as record:
        record.write(json.dumps({**vars(args), "cuda_visible_devices": visible,
                                 "pid": os.getpid()}) + "\n")
    os.execv(sys.executable, [sys.executable, "-m", "undertow.cli", "engine", "serve",
                              "--model", args.model_path, "--host", args.host[-1],
                              "--port", str(args.port),
                              f"weight_version={json.dumps(args.weight_version)}"])


if __name__ == "__main__":
    main(sys.argv[1:])
