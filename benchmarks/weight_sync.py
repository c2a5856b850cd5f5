"""Weight sync benchmark: seconds per GB by broadcast (gloo, CPU) and from disk, side by side.

    python -m benchmarks.weight_sync [--mib 512] [--engines 1,2] [--rounds 3]

A synthetic model directory of `--mib` MiB of fp32 tensors (shaped like a transformer's:
a few large matrices and many small vectors) is pushed by `learner.weight_sync.EngineWeightSync`
to 1 or 2 receiver processes that play SGLang 0.5.23's side of the updates
(`tests/learner/sglang_weight_receiver.py`: the same torch calls SGLang makes to join the
group and receive, and a safetensors read for `update_weights_from_disk`):
- `distributed`: the tensors from the learner's memory, broadcast over a gloo group on this
  machine's loopback (the group is formed once, before the timed rounds; its forming time is
  reported apart);
- `disk`: `update_weights_from_disk` of the directory, which the learner has written (the
  write is timed apart: the training loop writes the directory every step anyway); the files
  are in the page cache, so this is the best case of a disk load.
Best of `--rounds`. Writes `benchmarks/results/weight_sync.json` and prints a Markdown table.
This is a CPU machine: gloo over loopback says nothing about NCCL over NVLink or InfiniBand,
where a broadcast moves tens of GB/s; the figures are for comparing the two paths here.
"""

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from undertow.learner.weight_sync import EngineWeightSync, WeightSyncConfig

RESULTS = Path(__file__).parent / "results" / "weight_sync.json"
HIDDEN = 1024
LISTENING = "listening on "


def synthetic_tensors(num_bytes: int) -> dict[str, torch.Tensor]:
    """fp32 tensors of about `num_bytes`: per layer a (4H, H) matrix and two (H,) norms."""
    tensors, layer = {}, 0
    generator = torch.Generator().manual_seed(0)
    while sum(t.numel() * 4 for t in tensors.values()) < num_bytes:
        p = f"model.layers.{layer}."
        tensors[p + "mlp.weight"] = torch.randn(4 * HIDDEN, HIDDEN, generator=generator)
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN)
        layer += 1
    return tensors


@contextlib.contextmanager
def receivers(model_dir: Path, count: int):
    processes = [subprocess.Popen(
        [sys.executable, "-m", "tests.learner.sglang_weight_receiver", "--model",
         str(model_dir)], stdout=subprocess.PIPE, text=True) for _ in range(count)]
    try:
        yield [process.stdout.readline()[len(LISTENING):].strip() for process in processes]
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
            process.stdout.close()


def measure(model_dir: Path, tensors: dict, num_engines: int, rounds: int) -> dict:
    num_gb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9
    with receivers(model_dir, num_engines) as urls:
        sync = EngineWeightSync(urls, WeightSyncConfig(method="distributed", backend="gloo",
                                                       group_timeout_s=600.0),
                                named_tensors=tensors.items)
        started = time.perf_counter()
        sync.open()
        group_s = time.perf_counter() - started
        for version in range(1, rounds + 1):
            sync.push(model_dir, version)
        sync.close()
        disk = EngineWeightSync(urls, WeightSyncConfig(method="disk"))
        for version in range(1, rounds + 1):
            disk.push(model_dir, version)
    assert all(r.method == "distributed" for r in sync.reports), sync.reports
    distributed_s = min(r.seconds for r in sync.reports)
    disk_s = min(r.seconds for r in disk.reports)
    return {"engines": num_engines, "gb": num_gb, "group_forming_s": group_s,
            "distributed_s": distributed_s, "disk_s": disk_s,
            "distributed_s_per_gb": distributed_s / num_gb, "disk_s_per_gb": disk_s / num_gb}


def markdown(rows: list[dict], write_s_per_gb: float) -> str:
    lines = ["| engines | GB | broadcast s/GB (gloo) | disk load s/GB | group forming s |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['engines']} | {r['gb']:.2f} | {r['distributed_s_per_gb']:.2f} | "
                     f"{r['disk_s_per_gb']:.2f} | {r['group_forming_s']:.2f} |")
    lines.append(f"\nWriting the directory (safetensors, learner side): {write_s_per_gb:.2f} s/GB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--engines", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tensors = synthetic_tensors(args.mib * 2**20)
    num_gb = sum(t.numel() * 4 for t in tensors.values()) / 1e9
    with tempfile.TemporaryDirectory(prefix="undertow-bench-sync-") as work_dir:
        model_dir = Path(work_dir)
        started = time.perf_counter()
        save_file(tensors, str(model_dir / "model.safetensors"))
        write_s_per_gb = (time.perf_counter() - started) / num_gb
        rows = [measure(model_dir, tensors, int(n), args.rounds)
                for n in args.engines.split(",")]
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_average_1m": os.getloadavg()[0]},
              "settings": {"mib": args.mib, "rounds": args.rounds, "dtype": "float32",
                           "backend": "gloo (loopback)"},
              "write_s_per_gb": write_s_per_gb, "results": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(rows, write_s_per_gb))


if __name__ == "__main__":
    main()
