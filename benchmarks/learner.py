"""Learner benchmark: one training step's forward+backward on the same group tree by
tree packing, one sample per session, and one sample per call.

    python -m benchmarks.learner [--shapes full,scaled] [--per-call-every 10]
    python -m benchmarks.learner --fsdp2 [--shapes scaled]
    python -m benchmarks.learner --model qwen2.5-coder-0.5b-instruct [--shapes short]
        [--mixed-precision bf16] [--activation-checkpointing] [--optimizer]

The tree: S sessions x N turns sharing a P-token system-and-task prefix; each turn is
C sampled completion tokens then O new observation tokens, built through
`Tree.add_call` with token truth (each call's prompt is the previous prompt plus the
completion plus the new tokens). Synthetic token IDs (below 6000: in every model's
vocabulary), the tiny model in fp32, one torch thread. `--model` runs a pretrained model
instead: a directory, or a name of `MODELS` (looked up in .cache/models, where `make
setup-models` puts them), by default at the "short" shape (one group of 4 sessions, about
2k tokens, the size of one step of a small RL run), with the learner's options
`--mixed-precision bf16` (float32 master weights, bf16 compute), `--activation-checkpointing`
and `--optimizer` (the step's gradient clipping and AdamW too, so the peak holds AdamW's
state: a whole training step), and `--dtype bfloat16` (parameters, gradients and AdamW's
state in bf16: no float32 master weights). Each method runs in a FRESH subprocess and reports:

- step_s / step_cpu_s: wall and CPU time of forward+backward (CPU time is the
  process's, robust to other load on a shared machine; one thread) of the whole
  step (loss and gradients), after the model is loaded and a small warm-up step has run;
- peak_step_mib: the process's peak resident memory during the step minus its resident
  memory just before (on Linux the peak is reset there, `clear_refs`; elsewhere
  ru_maxrss after minus before, which reads 0 when loading peaked higher): activations
  kept for backward, attention temporaries, gradients (and AdamW's state with
  `--optimizer`). tracemalloc cannot see torch's allocations; this counts real pages,
  including allocator slack.
- peak_rss_mib: ru_maxrss at the end, everything included (weights, gradients, AdamW's
  state with `--optimizer`); trained_tokens_per_s: trained tokens (the terms of the
  loss, each sampled token once) per second of the step's wall time, and
  peak_step_kib_per_trained_token: peak_step_mib per trained token.

Per-call at the full shape costs tens of minutes on a 2-core machine, so by default
it runs every k-th call of each session (`--per-call-every`) and its time is scaled by
the ratio of attention-weighted work (sum over calls of L^2 + L*d) of all calls to the
sampled calls: marked "extrapolated" in the table, with the loss left out (a subset's
loss is not the step's). The scaled shape runs every method in full and checks that
the three losses agree.

A worker given `--tree-json` (a file as `tree_to_json` writes it) times that tree instead
of a shape's: `benchmarks/tree_worth.py` runs it on a run's stored trees.

`--fsdp2` runs the FSDP2 case instead (issue 15): the tree step in one process, then the
same step sharded over 2 gloo processes on this CPU (`sharding.py`: `fully_shard` over a
2-process mesh, micro-batches in rounds); each sharded process reports its own wall and
CPU time and peak, and the row says how far the sharded gradient is from the single
process's (max over parameters of max |difference| / max |gradient|). On a CPU the
sharded step is slower (gloo all-gathers and reduce-scatters every layer each round, and
the two processes share the cores); the point is memory per process and exactness.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SHAPES = {
    "full": {"prefix": 2000, "sessions": 8, "turns": 30, "completion": 100, "observation": 100},
    "scaled": {"prefix": 500, "sessions": 8, "turns": 10, "completion": 25, "observation": 25},
    "short": {"prefix": 400, "sessions": 4, "turns": 4, "completion": 50, "observation": 50},
}
RESULTS = Path(__file__).resolve().parent / "results" / "learner.json"
MAX_TOKENS = 16384
REPO = Path(__file__).resolve().parents[1]
MODELS = {"smollm2-135m-instruct": REPO / ".cache" / "models" / "smollm2-135m-instruct",
          "qwen2.5-coder-0.5b-instruct":
              REPO / ".cache" / "models" / "qwen2.5-coder-0.5b-instruct"}


def resolve_model(name_or_dir: str) -> Path:
    """A model directory: `name_or_dir` itself, or the cached directory of a `MODELS` name;
    SystemExit saying how to get it when neither holds a model."""
    path = MODELS.get(name_or_dir, Path(name_or_dir))
    if not (path / "config.json").is_file():
        raise SystemExit(f"no model at {path}: give a model directory, or fetch one of "
                         f"{sorted(MODELS)} with `make setup-models`")
    return path


def build_tree(shape: dict, seed: int = 0):
    from undertow.gateway.trees.tree import Tree

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


def _status_mib(field: str) -> float | None:
    """A `/proc/self/status` size (VmRSS, VmHWM) in MiB; None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> float | None:
    """Resets the process's peak resident size to its current one (Linux `clear_refs` 5)
    and returns that size in MiB, so that the step's own peak is seen even when loading
    the model peaked higher (a bf16 model read from float32 safetensors); None where
    the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return None
    return _status_mib("VmRSS")


def _work(length: int, hidden: int = 256) -> float:
    return length * length + length * hidden


@dataclass(frozen=True)
class LearnerOptions:
    """How the worker's policy trains: the learner config's fields of the same names,
    and `optimizer`: clip and step AdamW after the backward (a whole training step)."""

    mixed_precision: str = "none"
    activation_checkpointing: bool = False
    optimizer: bool = False
    dtype: str = "float32"

    def flags(self) -> list[str]:
        return (["--mixed-precision", self.mixed_precision, "--dtype", self.dtype]
                + ["--activation-checkpointing"] * self.activation_checkpointing
                + ["--optimizer"] * self.optimizer)


def run_worker(method: str, shape_name: str | None, model_dir: str, per_call_every: int,
               grads_out: str | None = None, max_tokens: int = MAX_TOKENS,
               options: LearnerOptions = LearnerOptions(), tree_json: str | None = None
               ) -> dict:
    """One method's step on the shape's tree, or on the tree in `tree_json` (a file as
    `tree_to_json` writes it), in this process."""
    import torch

    from undertow.gateway.trees.tree import tree_from_json
    from undertow.learner.advantages import group_advantages
    from undertow.learner.config import AdvantageConfig, LossConfig, torch_dtype
    from undertow.learner.model import PolicyModel
    from undertow.learner.objective import backward_step
    from undertow.learner.packing import pack_step
    from undertow.learner.reference import flat_loss, flat_samples
    from undertow.learner.sharding import compute_context

    torch.set_num_threads(1)
    if tree_json is None:
        assert shape_name is not None, "a worker times a shape or a tree_json"
        tree = build_tree(SHAPES[shape_name])
    else:
        tree = tree_from_json(json.loads(Path(tree_json).read_text()))
    advantages = {(tree.group_id, s): a
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    # Segments of the micro-batch bound, as `undertow train` sets them by default
    # (`TrainConfig.segment_tokens`): a packed micro-batch is never scored in segments.
    policy = PolicyModel.load(model_dir, dtype=torch_dtype(options.dtype),
                              max_segment_tokens=max_tokens,
                              activation_checkpointing=options.activation_checkpointing)
    config = LossConfig(name="token_mean")
    result = {"method": method, "shape": shape_name, "model": Path(model_dir).name,
              "num_parameters": sum(p.numel() for p in policy.model.parameters()),
              **dataclasses.asdict(options)}
    if method == "tree":
        step = pack_step([tree], advantages, max_tokens)
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
    compute = compute_context(torch.device("cpu"), options.mixed_precision)
    with compute:
        warm_up = policy.score_path(torch.arange(16), torch.arange(1, 16))
        warm_up.logprobs.sum().backward()
    policy.model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-6) if options.optimizer \
        else None
    before = _maxrss_mib()
    resident = _reset_peak_rss()
    start, start_cpu = time.perf_counter(), time.process_time()
    with compute:
        loss = run()
    if optimizer is not None:
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
    result["step_s"] = time.perf_counter() - start
    result["step_cpu_s"] = time.process_time() - start_cpu
    peak = _status_mib("VmHWM") if resident is not None else None
    result["peak_step_mib"] = peak - resident if peak is not None else _maxrss_mib() - before
    result["peak_rss_mib"] = _maxrss_mib()
    num_trained = sum(len(s.behaviour) for s in flat_samples([tree], advantages))
    result["num_trained_tokens"] = num_trained
    result["trained_tokens_per_s"] = num_trained / result["step_s"]
    result["peak_step_kib_per_trained_token"] = result["peak_step_mib"] * 1024 / num_trained
    if "scale" in result:
        result["step_s"] *= result["scale"]
        result["step_cpu_s"] *= result["scale"]
        result["trained_tokens_per_s"] /= result["scale"]
        result["num_tokens"] = sum(len(s.token_ids) for s in flat_samples(
            [tree], advantages, "call"))
    else:
        result["loss"] = loss
    if grads_out:
        from safetensors.torch import save_file

        save_file({n: p.grad.contiguous() for n, p in policy.model.named_parameters()},
                  grads_out)
    return result


FSDP2_WORLD_SIZE = 2
FSDP2_MAX_TOKENS = 1024
"""Micro-batches of the FSDP2 case: small, so that the step has several to share."""


def fsdp2_worker(rank: int, port: int, shape_name: str, model_dir: str, out_dir: str) -> None:
    """One process of the sharded cell: the tree step through `sharded_backward_step`."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    from undertow.learner.advantages import group_advantages
    from undertow.learner.config import AdvantageConfig, LossConfig
    from undertow.learner.model import PolicyModel
    from undertow.learner.packing import pack_step
    from undertow.learner.sharding import shard_policy, sharded_backward_step

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=FSDP2_WORLD_SIZE)
    try:
        tree = build_tree(SHAPES[shape_name])
        advantages = {(tree.group_id, s): a
                      for s, a in group_advantages(tree, AdvantageConfig()).items()}
        step = pack_step([tree], advantages, FSDP2_MAX_TOKENS)
        policy = PolicyModel.load(model_dir)
        shard_policy(policy, init_device_mesh("cpu", (FSDP2_WORLD_SIZE,)))
        before = _maxrss_mib()
        start, start_cpu = time.perf_counter(), time.process_time()
        stats = sharded_backward_step(policy, step, LossConfig(name="token_mean"), rank,
                                      FSDP2_WORLD_SIZE)
        result = {"rank": rank, "step_s": time.perf_counter() - start,
                  "step_cpu_s": time.process_time() - start_cpu,
                  "peak_step_mib": _maxrss_mib() - before, "loss": stats.get("loss", 0.0),
                  "num_local_parameters": sum(p.to_local().numel()
                                              for p in policy.model.parameters()),
                  "num_tokens": step.num_packed_tokens,
                  "num_micro_batches": len(step.micro_batches)}
        grads = {n: p.grad.full_tensor().contiguous() for n, p in policy.model.named_parameters()}
        if rank == 0:
            save_file(grads, str(Path(out_dir) / "fsdp2-grads.safetensors"))
        Path(out_dir, f"fsdp2-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_fsdp2_case(shape: str, model_dir: Path, scratch: Path, timeout_s: int) -> list[dict]:
    """The tree step in one process and sharded over two; rows for both."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    single_grads = scratch / "single-grads.safetensors"
    command = [sys.executable, "-m", "benchmarks.learner", "--worker", "tree", "--shape", shape,
               "--model-dir", str(model_dir), "--grads-out", str(single_grads),
               "--max-tokens", str(FSDP2_MAX_TOKENS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"tree/{shape} failed:\n{done.stderr[-3000:]}")
    single = json.loads(done.stdout.strip().splitlines()[-1])
    single["method"] = "tree, 1 process"
    store = dist.TCPStore("127.0.0.1", 0, world_size=FSDP2_WORLD_SIZE + 1, is_master=True,
                          wait_for_workers=False)
    context = mp.get_context("spawn")
    processes = [context.Process(target=fsdp2_worker, args=(rank, store.port, shape,
                                                            str(model_dir), str(scratch)))
                 for rank in range(FSDP2_WORLD_SIZE)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=timeout_s)
        if process.exitcode != 0:
            raise RuntimeError(f"an FSDP2 process of {shape} exited with {process.exitcode}")
    ranks = [json.loads((scratch / f"fsdp2-{r}.json").read_text())
             for r in range(FSDP2_WORLD_SIZE)]
    expected, sharded = load_file(str(single_grads)), load_file(
        str(scratch / "fsdp2-grads.safetensors"))
    error = max(float((sharded[n] - g).abs().max() / g.abs().max()) for n, g in expected.items())
    rows = [single]
    for r in ranks:
        rows.append({"method": f"fsdp2 rank {r['rank']} of {FSDP2_WORLD_SIZE} (gloo)",
                     "shape": shape, "num_tokens": r["num_tokens"], "step_s": r["step_s"],
                     "step_cpu_s": r["step_cpu_s"], "peak_step_mib": r["peak_step_mib"],
                     "num_local_parameters": r["num_local_parameters"],
                     "grad_rel_error": error,
                     "loss": sum(x["loss"] for x in ranks)})
    return rows


def run_fsdp2(shapes: list[str], timeout_s: int) -> list[dict]:
    from undertow.learner.modeldir import init_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = init_model_dir(Path(scratch) / "tiny", size="tiny", seed=0)
        for shape in shapes:
            for row in run_fsdp2_case(shape, model_dir, Path(scratch), timeout_s):
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = RESULTS.with_name("learner_fsdp2.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shapes": SHAPES, "max_tokens": FSDP2_MAX_TOKENS, "rows": rows},
                              indent=2) + "\n")
    return rows


def fsdp2_table(rows: list[dict]) -> str:
    lines = ["| shape | method | tokens | step s (wall) | step s (CPU) | peak step MiB "
             "| loss (sum) | gradient vs 1 process |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        error = f"{r['grad_rel_error']:.1e}" if "grad_rel_error" in r else "reference"
        lines.append(f"| {r['shape']} | {r['method']} | {r['num_tokens']} | {r['step_s']:.1f} "
                     f"| {r['step_cpu_s']:.1f} | {r['peak_step_mib']:.0f} | {r['loss']:.6f} "
                     f"| {error} |")
    return "\n".join(lines)


def run_side_by_side(shapes: list[str], per_call_every: int, timeout_s: int,
                     model_dir: Path | None = None,
                     options: LearnerOptions = LearnerOptions(),
                     methods: tuple[str, ...] = ("tree", "per_session", "per_call")
                     ) -> list[dict]:
    """Each method at each shape, on `model_dir` (None: the tiny model, built here)."""
    from undertow.learner.modeldir import init_model_dir

    rows = []
    results = RESULTS if model_dir is None else RESULTS.with_name(
        f"learner_{model_dir.name}.json")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = model_dir or init_model_dir(Path(scratch) / "tiny", size="tiny", seed=0)
        for shape in shapes:
            tree = build_tree(SHAPES[shape])
            for method in methods:
                every = per_call_every if shape == "full" else 1
                command = [sys.executable, "-m", "benchmarks.learner", "--worker", method,
                           "--shape", shape, "--model-dir", str(model_dir),
                           "--per-call-every", str(every), *options.flags()]
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
                if done.returncode:
                    raise RuntimeError(f"{method}/{shape} failed:\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row.update(unique_tokens=tree.num_unique_tokens,
                           flat_call_tokens=tree.num_flat_tokens)
                rows.append(row)
                print(json.dumps(row), flush=True)
                results.parent.mkdir(parents=True, exist_ok=True)
                results.write_text(json.dumps({"shapes": SHAPES, "max_tokens": MAX_TOKENS,
                                               "rows": rows}, indent=2) + "\n")
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | shape | method | tokens run | step s (wall) | step s (CPU) "
             "| vs tree (CPU) | trained tok/s | peak step MiB | KiB / trained token "
             "| peak RSS MiB | loss |", "|---|---|---|" + "---:|" * 9]
    tree_time = {r["shape"]: r["step_cpu_s"] for r in rows if r["method"] == "tree"}
    for r in rows:
        note = " (extrapolated)" if "scale" in r else ""
        loss = f"{r['loss']:.6f}" if "loss" in r else "n/a"
        peak = f"{r['peak_step_mib']:.0f}" if "scale" not in r else "n/a"
        per_token = (f"{r['peak_step_kib_per_trained_token']:.0f}" if "scale" not in r
                     else "n/a")
        ratio = (f"{r['step_cpu_s'] / tree_time[r['shape']]:.2f}x"
                 if r["shape"] in tree_time else "n/a")
        lines.append(f"| {r['model']} | {r['shape']} | {r['method']}{note} | {r['num_tokens']} "
                     f"| {r['step_s']:.1f} | {r['step_cpu_s']:.1f} | {ratio} "
                     f"| {r['trained_tokens_per_s']:.1f} | {peak} | {per_token} "
                     f"| {r['peak_rss_mib']:.0f} | {loss} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="scaled,full")
    parser.add_argument("--per-call-every", type=int, default=10)
    parser.add_argument("--timeout-s", type=int, default=3600)
    parser.add_argument("--worker", choices=["tree", "per_session", "per_call"])
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--tree-json", help="(worker) time this tree (as `tree_to_json` "
                        "writes it) instead of --shape's")
    parser.add_argument("--model-dir")
    parser.add_argument("--grads-out", help="(worker) write the step's gradients here")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                        help="(worker) micro-batch bound")
    parser.add_argument("--fsdp2", action="store_true",
                        help="the FSDP2 case: 2 gloo processes vs 1 (default shape: scaled)")
    parser.add_argument("--model", help=f"a pretrained model: a directory or one of "
                        f"{sorted(MODELS)} (default shape: short)")
    parser.add_argument("--methods", default="tree,per_session,per_call")
    parser.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the parameters' dtype (learner.dtype; bf16 compute on float32 "
                        "master weights is --mixed-precision bf16)")
    parser.add_argument("--optimizer", action="store_true",
                        help="clip and step AdamW after the backward (a whole training step)")
    args = parser.parse_args(argv)
    options = LearnerOptions(args.mixed_precision, args.activation_checkpointing,
                             args.optimizer, args.dtype)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.shape, args.model_dir,
                                    args.per_call_every, args.grads_out, args.max_tokens,
                                    options, args.tree_json)))
        return
    if args.model:
        default = args.shapes == parser.get_default("shapes")
        shapes = ["short"] if default else args.shapes.split(",")
        rows = run_side_by_side(shapes, args.per_call_every, args.timeout_s,
                                resolve_model(args.model), options,
                                tuple(args.methods.split(",")))
        print(table(rows))
        return
    if args.fsdp2:
        default = args.shapes == parser.get_default("shapes")
        shapes = ["scaled"] if default else args.shapes.split(",")
        print(fsdp2_table(run_fsdp2(shapes, args.timeout_s)))
        return
    rows = run_side_by_side(args.shapes.split(","), args.per_call_every, args.timeout_s,
                            options=options, methods=tuple(args.methods.split(",")))
    print(table(rows))


if __name__ == "__main__":
    main()
