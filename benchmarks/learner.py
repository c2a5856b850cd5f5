"""Learner benchmark: one training step's forward+backward on the same group tree by
tree packing, one sample per session, and one sample per call.

    python -m benchmarks.learner [--shapes full,scaled] [--per-call-every 10]

The tree: S sessions x N turns sharing a P-token system-and-task prefix; each turn is
C sampled completion tokens then O new observation tokens, built through
`Tree.add_call` with token truth (each call's prompt is the previous prompt plus the
completion plus the new tokens). Synthetic token IDs, the tiny model in fp32, one
torch thread. Each method runs in a FRESH subprocess and reports:

- step_s / step_cpu_s: wall and CPU time of forward+backward (CPU time is the
  process's, robust to other load on a shared machine; one thread) of the whole
  step (loss and gradients), after the model is loaded and a small warm-up step has run;
- peak_step_mib: ru_maxrss after the step minus ru_maxrss before it. ru_maxrss is the
  process's peak resident memory, so the delta is how far the step pushed the peak
  above everything already resident (model, data, warm-up): activations kept for
  backward, attention temporaries and gradients. tracemalloc cannot see torch's
  allocations; this counts real pages, including allocator slack.

Per-call at the full shape costs tens of minutes on a 2-core machine, so by default
it runs every k-th call of each session (`--per-call-every`) and its time is scaled by
the ratio of attention-weighted work (sum over calls of L^2 + L*d) of all calls to the
sampled calls: marked "extrapolated" in the table, with the loss left out (a subset's
loss is not the step's). The scaled shape runs every method in full and checks that
the three losses agree.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "full": {"prefix": 2000, "sessions": 8, "turns": 30, "completion": 100, "observation": 100},
    "scaled": {"prefix": 500, "sessions": 8, "turns": 10, "completion": 25, "observation": 25},
}
RESULTS = Path(__file__).resolve().parent / "results" / "learner.json"
MAX_TOKENS = 16384


def build_tree(shape: dict, seed: int = 0):
    from undertow.gateway.tree import Tree

    rng = random.Random(seed)
    tree = Tree("bench")
    prefix = [rng.randrange(6000) for _ in range(shape["prefix"])]
    for index in range(shape["sessions"]):
        session_id = f"s{index}"
        prompt = list(prefix)
        for turn in range(shape["turns"]):
            completion = [rng.randrange(6000) for _ in range(shape["completion"])]
            logprobs = [rng.uniform(-9.5, -8.0) for _ in completion]
            tree.add_call(f"{session_id}-{turn}", session_id, prompt, completion, logprobs,
                          [0] * len(completion))
            prompt = prompt + completion + [rng.randrange(6000)
                                            for _ in range(shape["observation"])]
        tree.close_session(session_id, reward=float(index % 3 == 0))
    return tree


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _work(length: int, hidden: int = 256) -> float:
    return length * length + length * hidden


def run_worker(method: str, shape_name: str, model_dir: str, per_call_every: int) -> dict:
    import torch

    from undertow.learner.advantages import AdvantageConfig, group_advantages
    from undertow.learner.losses import LossConfig
    from undertow.learner.model import PolicyModel
    from undertow.learner.objective import backward_step
    from undertow.learner.packing import pack_step
    from undertow.learner.reference import flat_loss, flat_samples

    torch.set_num_threads(1)
    tree = build_tree(SHAPES[shape_name])
    advantages = {(tree.group_id, s): a
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    policy = PolicyModel.load(model_dir)
    config = LossConfig(name="token_mean")
    result = {"method": method, "shape": shape_name}
    if method == "tree":
        step = pack_step([tree], advantages, MAX_TOKENS)
        result.update(num_micro_batches=len(step.micro_batches),
                      num_tokens=step.num_packed_tokens)

        def run():
            return backward_step(policy, step, config)["loss"]
    else:
        samples = flat_samples([tree], advantages, "session" if method == "per_session"
                               else "call")
        work = [_work(len(s.token_ids)) for s in samples]
        if method == "per_call" and per_call_every > 1:
            picked = list(range(per_call_every // 2, len(samples), per_call_every))
            result["extrapolated_from"] = len(picked)
            result["scale"] = sum(work) / sum(work[i] for i in picked)
            samples = [samples[i] for i in picked]
        result["num_tokens"] = sum(len(s.token_ids) for s in samples)

        def run():
            return flat_loss(policy, samples, config)
    warm_up = policy.score_path(torch.arange(16), torch.arange(1, 16))
    warm_up.logprobs.sum().backward()
    policy.model.zero_grad(set_to_none=True)
    before = _maxrss_mib()
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = run()
    result["step_s"] = time.perf_counter() - start
    result["step_cpu_s"] = time.process_time() - start_cpu
    result["peak_step_mib"] = _maxrss_mib() - before
    if "scale" in result:
        result["step_s"] *= result["scale"]
        result["step_cpu_s"] *= result["scale"]
        result["num_tokens"] = sum(len(s.token_ids) for s in flat_samples(
            [tree], advantages, "call"))
    else:
        result["loss"] = loss
    return result


def run_side_by_side(shapes: list[str], per_call_every: int, timeout_s: int) -> list[dict]:
    from undertow.learner.modeldir import init_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = init_model_dir(Path(scratch) / "tiny", size="tiny", seed=0)
        for shape in shapes:
            tree = build_tree(SHAPES[shape])
            for method in ("tree", "per_session", "per_call"):
                every = per_call_every if shape == "full" else 1
                command = [sys.executable, "-m", "benchmarks.learner", "--worker", method,
                           "--shape", shape, "--model-dir", str(model_dir),
                           "--per-call-every", str(every)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
                if done.returncode:
                    raise RuntimeError(f"{method}/{shape} failed:\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row.update(unique_tokens=tree.num_unique_tokens,
                           flat_call_tokens=tree.num_flat_tokens)
                rows.append(row)
                print(json.dumps(row), flush=True)
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps({"shapes": SHAPES, "max_tokens": MAX_TOKENS,
                                               "rows": rows}, indent=2) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape | method | tokens run | step s (wall) | step s (CPU) | vs tree (CPU) "
             "| peak step MiB | loss |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    tree_time = {r["shape"]: r["step_cpu_s"] for r in rows if r["method"] == "tree"}
    for r in rows:
        note = " (extrapolated)" if "scale" in r else ""
        loss = f"{r['loss']:.6f}" if "loss" in r else "n/a"
        peak = f"{r['peak_step_mib']:.0f}" if "scale" not in r else "n/a"
        lines.append(f"| {r['shape']} | {r['method']}{note} | {r['num_tokens']} | "
                     f"{r['step_s']:.1f} | {r['step_cpu_s']:.1f} | "
                     f"{r['step_cpu_s'] / tree_time[r['shape']]:.2f}x | "
                     f"{peak} | {loss} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="scaled,full")
    parser.add_argument("--per-call-every", type=int, default=10)
    parser.add_argument("--timeout-s", type=int, default=3600)
    parser.add_argument("--worker", choices=["tree", "per_session", "per_call"])
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--model-dir")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.shape, args.model_dir,
                                    args.per_call_every)))
        return
    rows = run_side_by_side(args.shapes.split(","), args.per_call_every, args.timeout_s)
    print(table(rows))


if __name__ == "__main__":
    main()
