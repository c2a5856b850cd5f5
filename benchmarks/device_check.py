"""The GPU check (issue 15): `make device-check`, one unattended script for a GPU machine.

    python -m benchmarks.device_check [--model-dir DIR] [--shape full|scaled]

Needs only torch (CUDA), triton and transformers plus the project's small wheels, and no
network. On a machine with CUDA it:
1. builds a model of Qwen3-0.6B's shape with random weights (`undertow model init --size
   qwen3-0.6b`, nothing from a hub) unless `--model-dir` names one;
2. trains 3 tree-packed steps of one group tree (benchmarks.learner's shape) on the GPU:
   FSDP2 (`sharding.shard_policy`, a one-GPU mesh over NCCL) with bf16 compute and float32
   master weights, activation checkpointing, flex_attention tree masks; reports training
   tokens/s and model FLOPs utilisation (the steps after the first, which compiles);
3. checks flex_attention against dense masked attention on the same trees (the first
   micro-batch when packed at 4096 tokens; an unsharded float32 copy: logprobs and the
   gradient);
4. times the weight sync's learner side: gathering the full weights and writing them as
   the model directory an engine loads (`update_weights_from_disk`);
5. starts the built-in engine on the GPU (`engine serve --device cuda`: bf16 weights and
   KV) and measures decode tokens/s at concurrency 1 and 32 as `benchmarks.engine` does
   (32-token prompts, 128 greedy tokens each, best of 3 rounds after a warm-up);
6. runs one step of the elastic pool on the GPU (`pool_row`): two member processes
   sharing cuda:0 (`elastic.local.ProcessMembers` with the run's `learner` section:
   bf16 compute, activation checkpointing) train the "scaled" tree's micro-batches
   while a coordinator in this process sums their gradients; the sum is compared with
   the plain run's step (`sharding.place`, `Placement.compute`) on the same GPU;
7. runs `benchmarks/device_check_sglang.py` (SGLang's part) where that file exists.
`--checks` picks parts (train, flex, pool, engine, sglang; all by default); a part not
picked has its rows "not run". Without CUDA every row says "not run: no CUDA" and the
script exits 0. It prints a Markdown table and writes
`benchmarks/results/device_check.json`; the exit code is 1 when a check that ran failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "device_check.json"
SGLANG_CHECK = Path(__file__).parent / "device_check_sglang.py"
NUM_STEPS = 3
MICRO_BATCH_TOKENS = 16384
FLEX_TOLERANCE = 2e-3
FLEX_CHECK_TOKENS = 4096
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12,
                   "A800": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12}
"""Dense bf16 tensor-core peak by device name (no sparsity)."""
ROWS = ("training tokens/s", "model FLOPs utilisation", "flex vs dense attention",
        "weight sync, learner side (s)", "decode tokens/s, concurrency 1",
        "decode tokens/s, concurrency 32", "elastic pool step, 2 members on one GPU",
        "SGLang checks")
PARTS = {"train": ROWS[0:2] + ROWS[3:4], "flex": ROWS[2:3], "engine": ROWS[4:6],
         "pool": ROWS[6:7], "sglang": ROWS[7:8]}
"""Each part `--checks` can pick, and the rows it writes."""
POOL_MEMBERS = 2
POOL_MAX_TOKENS = 1024
POOL_TOLERANCE = 1e-3
"""Of each parameter's largest gradient. The pool's step uses dr_grpo over the scaled
tree's 8 sessions with C = 4096, a power-of-two normaliser, so the members' unnormalised
weights and the plain run's normalised ones round every bf16 value alike; what is left
is the order of float32 additions over micro-batches (about 1e-6) and the GPU kernels'
own run-to-run noise (atomic adds in the embedding's backward); bf16 compute against
float32 differs by about 3e-2 on the tiny model, so a member that ignored the settings
fails."""


def row(check: str, status: str, value: str = "", note: str = "") -> dict:
    return {"check": check, "status": status, "value": value, "note": note}


def no_cuda_rows(reason: str) -> list[dict]:
    return [row(name, "not run", note=reason) for name in ROWS[:-1]]


def parse_checks(value: str) -> tuple[str, ...]:
    """`--checks`: comma-separated parts of `PARTS` ("all": every one), in PARTS' order."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if names == ["all"]:
        return tuple(PARTS)
    unknown = sorted(set(names) - set(PARTS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown checks {unknown or names}; pick from "
                                         f"{', '.join(PARTS)} or all")
    return tuple(name for name in PARTS if name in names)


def in_table_order(rows: list[dict], checks: tuple[str, ...]) -> list[dict]:
    """`rows` in `ROWS` order, each row of a part not in `checks` as "not run", and
    any row not named in ROWS (an error) at the end."""
    by_check = {r["check"]: r for r in rows}
    skipped = {name for part in PARTS if part not in checks for name in PARTS[part]}
    ordered = [row(name, "not run", note="not picked (--checks)") if name in skipped
               else by_check[name] for name in ROWS if name in skipped or name in by_check]
    return ordered + [r for r in rows if r["check"] not in ROWS]


def gradient_error(got: dict, expected: dict) -> float:
    """The largest difference between two gradients (name -> tensor), relative to each
    parameter's largest expected value; ValueError for a parameter whose expected
    gradient is zero everywhere (the comparison would be vacuous) or missing."""
    if set(got) != set(expected):
        raise ValueError(f"the gradients name other parameters: "
                         f"{sorted(set(got) ^ set(expected))[:4]}")
    errors = []
    for name, reference in expected.items():
        scale = float(reference.abs().max())
        if scale == 0.0:
            raise ValueError(f"{name}: the expected gradient is zero; nothing to compare")
        errors.append(float((got[name].float() - reference.float()).abs().max()) / scale)
    return max(errors)


def pool_status(error: float, claims: dict[str, list[int]], num_micro_batches: int,
                tolerance: float = POOL_TOLERANCE) -> tuple[str, str]:
    """The pool row's status and note: passed when the gradient is within `tolerance`,
    every micro-batch was trained exactly once, and every member trained some."""
    claimed = sorted(index for indices in claims.values() for index in indices)
    problems = []
    if error > tolerance:
        problems.append(f"gradient error {error:.1e} > {tolerance:g}")
    if claimed != list(range(num_micro_batches)):
        problems.append(f"claims {claimed} are not each of {num_micro_batches} once")
    idle = sorted(name for name, indices in claims.items() if not indices)
    if idle or len(claims) < POOL_MEMBERS:
        problems.append(f"members {idle or sorted(claims)} trained nothing")
    split = ", ".join(f"{name}: {len(indices)}" for name, indices in sorted(claims.items()))
    note = f"{num_micro_batches} micro-batches ({split}); tolerance {tolerance:g}"
    return ("FAILED" if problems else "passed"), "; ".join(problems + [note])


def peak_flops(device_name: str) -> float | None:
    """The device's bf16 peak, matched on its name (e.g. "NVIDIA H200")."""
    for name, flops in sorted(PEAK_BF16_FLOPS.items(), key=lambda item: -len(item[0])):
        if name in device_name:
            return flops
    return None


def model_flops(config, step) -> float:
    """Model FLOPs of one training step (forward and backward, 3x the forward; the
    recomputation of checkpointing is not counted, as MFU does): 6 per parameter of the
    decoder's matmuls per packed token, 6 per head weight per scored token, and the
    attention's 12 * heads * head_dim per (query, visible key) pair and layer."""
    from undertow.learner.attention import attention_blocks

    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_attention_heads * head_dim
    kv_size = config.num_key_value_heads * head_dim
    per_layer = hidden * (2 * q_size + 2 * kv_size) + 3 * hidden * config.intermediate_size
    num_pairs = 0
    for micro_batch in step.micro_batches:
        for start, end, ranges in attention_blocks(micro_batch).chunks:
            num_queries = end - start
            num_keys = sum(b - a for a, b in ranges)
            num_pairs += num_queries * num_keys - num_queries * (num_queries - 1) // 2
    return (6 * config.num_hidden_layers * per_layer * step.num_packed_tokens
            + 6 * config.vocab_size * hidden * step.num_terms
            + 12 * config.num_hidden_layers * q_size * num_pairs)


def packed_step(shape: str, max_tokens: int = MICRO_BATCH_TOKENS):
    from benchmarks.learner import SHAPES, build_tree
    from undertow.learner.advantages import group_advantages
    from undertow.learner.config import AdvantageConfig
    from undertow.learner.packing import pack_step

    tree = build_tree(SHAPES[shape])
    advantages = {(tree.group_id, s): a
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    return pack_step([tree], advantages, max_tokens)


def train_rows(model_dir: Path, shape: str, device_type: str = "cuda") -> list[dict]:
    """Rows 1, 2 and 4: three FSDP2 bf16 steps with flex attention on one GPU. With
    `device_type` "cpu" (the tests' dry run of this path) the mesh is gloo's and the
    attention is block tree attention (flex_attention has no CPU backward)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from undertow.learner.config import LossConfig
    from undertow.learner.model import PolicyModel
    from undertow.learner.sharding import full_parameters, shard_policy, sharded_backward_step

    cuda = device_type == "cuda"
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        policy = PolicyModel.load(model_dir, attention="flex" if cuda else "blocks",
                                  activation_checkpointing=True)
        policy.model.to(device_type)
        shard_policy(policy, init_device_mesh(device_type, (1,)), mixed_precision="bf16")
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-5)
        step, config = packed_step(shape), LossConfig(name="token_mean")
        seconds = []
        for _ in range(NUM_STEPS):
            synchronize()
            started_s = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            sharded_backward_step(policy, step, config, rank=0, world_size=1)
            torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
            optimizer.step()
            synchronize()
            seconds.append(time.perf_counter() - started_s)
        timed_s = sum(seconds[1:]) / (NUM_STEPS - 1)
        tokens_per_s = step.num_packed_tokens / timed_s
        device_name = torch.cuda.get_device_name() if cuda else "CPU"
        peak = peak_flops(device_name)
        flops_per_s = model_flops(policy.model.config, step) / timed_s
        started_s = time.perf_counter()
        _write_weights(full_parameters(policy))
        sync_s = time.perf_counter() - started_s
    finally:
        dist.destroy_process_group()
    note = (f"{step.num_packed_tokens} packed tokens in {len(step.micro_batches)} "
            f"micro-batches; step 1 (compiles) {seconds[0]:.1f} s, steps 2-3 {timed_s:.2f} s")
    return [row(ROWS[0], "passed", f"{tokens_per_s:,.0f}", note),
            row(ROWS[1], "passed" if peak else "measured",
                f"{flops_per_s / peak:.1%}" if peak else f"{flops_per_s / 1e12:.0f} TFLOP/s",
                f"peak {peak / 1e12:.0f} TFLOP/s bf16" if peak else
                f"no peak known for {device_name}"),
            row(ROWS[3], "passed", f"{sync_s:.2f}", "gather + write model.safetensors "
                "(bf16 engines load it by update_weights_from_disk)")]


def _write_weights(parameters: dict) -> None:
    """Writes the weights in bf16 as an engine would load them (then removes them)."""
    import torch
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="device-check-weights-") as out:
        save_file({name: t.to(torch.bfloat16).contiguous() for name, t in parameters.items()},
                  str(Path(out) / "model.safetensors"))


def flex_row(model_dir: Path, shape: str) -> dict:
    """Row 3: flex against dense attention, logprobs and gradient, float32."""
    import torch

    from undertow.learner.config import LossConfig
    from undertow.learner.model import PolicyModel
    from undertow.learner.objective import backward_step
    from undertow.learner.sharding import step_to

    policy = PolicyModel.load(model_dir)
    policy.model.to("cuda").train()
    # The same trees, packed smaller: a dense float32 backward keeps every layer's
    # activations and a (T, T) mask.
    whole = step_to(packed_step(shape, FLEX_CHECK_TOKENS), torch.device("cuda"))
    step = dataclasses.replace(whole, micro_batches=whole.micro_batches[:1])
    results = {}
    for attention in ("flex", "dense"):
        policy.attention = attention
        policy.model.zero_grad(set_to_none=True)
        backward_step(policy, step, LossConfig(name="token_mean"))
        with torch.no_grad():
            logprobs = policy.score(step.micro_batches[0]).logprobs
        grads = [p.grad.detach().clone() for p in policy.model.parameters()]
        results[attention] = (logprobs, grads)
    logprob_error = float((results["flex"][0] - results["dense"][0]).abs().max())
    grad_error = max(float((f - d).abs().max() / d.abs().max().clamp_min(1e-30))
                     for f, d in zip(results["flex"][1], results["dense"][1], strict=True))
    ok = logprob_error <= FLEX_TOLERANCE and grad_error <= FLEX_TOLERANCE
    del policy
    torch.cuda.empty_cache()
    return row(ROWS[2], "passed" if ok else "FAILED",
               f"logprob {logprob_error:.1e}, gradient {grad_error:.1e}",
               f"max abs / relative to each parameter's scale, tolerance {FLEX_TOLERANCE:g}; "
               f"{step.micro_batches[0].num_tokens} tokens")


def pool_row(model_dir: Path, device_type: str = "cuda", timeout_s: float = 300.0,
             shape: str | dict = "scaled", max_tokens: int = POOL_MAX_TOKENS) -> dict:
    """Row 7: one elastic pool step on `POOL_MEMBERS` member processes sharing the GPU
    (cuda:0; on "cpu", the tests' dry run, CPU processes) against the plain step, on
    one tree of `shape` (a name in benchmarks.learner.SHAPES, or such a dict) packed
    in micro-batches of `max_tokens`."""
    from benchmarks.learner import SHAPES, build_tree
    from undertow.learner.config import TrainConfig

    learner = TrainConfig(device=device_type, mixed_precision="bf16",
                          activation_checkpointing=True)
    tree = build_tree(SHAPES[shape] if isinstance(shape, str) else shape)
    packed = _pool_packed([tree], max_tokens)
    started_s = time.perf_counter()
    expected = _plain_gradient(model_dir, learner, packed)
    got, result = _pool_gradient(model_dir, learner, packed, timeout_s)
    error = gradient_error(got, expected)
    status, note = pool_status(error, result.claims, result.num_micro_batches)
    return row(ROWS[6], status, f"gradient {error:.1e}",
               f"{note}; bf16 compute, checkpointing, {device_type}; "
               f"{time.perf_counter() - started_s:.0f} s with process starts")


def _pool_loss():
    from undertow.learner.config import LossConfig

    return LossConfig(name="dr_grpo", dr_grpo_num_tokens=4096)


def _pool_packed(trees, max_tokens: int):
    from undertow.learner.advantages import group_advantages
    from undertow.learner.config import AdvantageConfig
    from undertow.learner.packing import pack_step

    advantages = {(tree.group_id, s): a for tree in trees
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    return pack_step(trees, advantages, max_tokens)


def _plain_gradient(model_dir: Path, learner, packed) -> dict:
    """The plain run's step (`train.Learner.train_step`'s placement), on the CPU after."""
    import torch

    from undertow.learner.model import PolicyModel
    from undertow.learner.objective import backward_step
    from undertow.learner.sharding import place

    policy = PolicyModel.load(model_dir)
    policy.model.train()
    placement = place(learner, policy)
    with placement.compute():
        backward_step(policy, placement.prepare(packed), _pool_loss())
    grads = {name: p.grad.detach().float().cpu() for name, p in policy.model.named_parameters()}
    del policy
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return grads


def _pool_gradient(model_dir: Path, learner, packed, timeout_s: float):
    """The same step on the pool's member processes; the coordinator's gradient and the
    step's result. The chunk is appended once both members hold a ticket, so each
    trains part of it."""
    from undertow.cells.elastic.local import ProcessMembers
    from undertow.cells.elastic.step import Coordinator
    from undertow.learner.model import PolicyModel
    from undertow.learner.sharding import place

    policy = PolicyModel.load(model_dir)
    place(learner, policy)
    coordinator = Coordinator(policy, timeout_s=timeout_s)
    members = ProcessMembers(coordinator.address, model_dir, timeout_s=timeout_s,
                             learner=learner)
    try:
        coordinator.open_step(0, _pool_loss())
        for cell_id in range(POOL_MEMBERS):
            members.start(cell_id)
            members.join(cell_id, 0)
        deadline = time.monotonic() + timeout_s
        while coordinator.num_claimed() < POOL_MEMBERS:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the members drew no ticket within {timeout_s} s")
            time.sleep(0.05)
        coordinator.append(packed)
        result = coordinator.finish_step()
        for cell_id in range(POOL_MEMBERS):
            members.stop(cell_id)
    finally:
        members.close()
        coordinator.close()
    grads = {name: p.grad.detach().float().cpu() for name, p in policy.model.named_parameters()}
    return grads, result


def sglang_row(model_dir: Path | None) -> dict:
    """Row 8: SGLang's part, by its own script, where it exists."""
    if not SGLANG_CHECK.exists():
        return row(ROWS[7], "not run", note=f"{SGLANG_CHECK.name} is not in this checkout")
    command = [sys.executable, "-m", "benchmarks.device_check_sglang"]
    if model_dir is not None:
        command += ["--model", str(model_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    results = SGLANG_CHECK.parent / "results" / "device_check_sglang.json"
    reason = ""
    if results.exists():
        reason = json.loads(results.read_text()).get("skipped", "")
    if done.returncode:
        return row(ROWS[7], "FAILED", note=(done.stdout + done.stderr)[-300:])
    return row(ROWS[7], "not run" if reason else "passed", note=reason or
               "see benchmarks/results/device_check_sglang.json")


def engine_rows(model_dir: Path) -> list[dict]:
    """Rows 5 and 6: the built-in engine's decode tokens/s on CUDA (step 5 above)."""
    import asyncio

    try:
        throughput = asyncio.run(engine_decode(model_dir))
    except Exception as error:   # the training rows above still stand
        note = f"{type(error).__name__}: {error}"[:300]
        return [row(ROWS[4], "FAILED", note=note), row(ROWS[5], "FAILED", note=note)]
    note = "built-in engine, --device cuda (bf16 weights and KV)"
    return [row(ROWS[4], "passed", f"{throughput[1]:.0f}", note),
            row(ROWS[5], "passed", f"{throughput[32]:.0f}", note)]


async def engine_decode(model_dir: Path) -> dict[int, float]:
    """Decode tokens/s of the built-in engine on CUDA at concurrency 1 and 32."""
    import aiohttp

    from benchmarks.engine import TIMEOUT, complete, decode_throughput, token_ids
    from undertow.gateway.engines.launch import BuiltinLauncher, launch_engine

    launcher = BuiltinLauncher(overrides={"device": "cuda"})
    async with launch_engine(launcher, model_dir) as engine, \
            aiohttp.ClientSession(timeout=TIMEOUT) as session:
        model = str(model_dir)
        await complete(session, engine.url, model, token_ids(1, 64), 4)
        return {c: await decode_throughput(session, engine.url, model, c) for c in (1, 32)}


def gpu_rows(model_dir: Path | None, shape: str,
             checks: tuple[str, ...] = tuple(PARTS)) -> tuple[list[dict], Path]:
    from undertow.learner.modeldir import ensure_model_dir

    if model_dir is None:
        model_dir = ensure_model_dir(Path(tempfile.gettempdir()) / "undertow-qwen3-0.6b",
                                     size="qwen3-0.6b")
    parts = {"train": lambda: train_rows(model_dir, shape),
             "flex": lambda: [flex_row(model_dir, shape)],
             "pool": lambda: [pool_row(model_dir)]}
    rows = []
    for name, build in parts.items():
        if name not in checks:
            continue
        try:
            rows += build()
        except Exception as error:   # one failed part must not hide the others' rows
            rows.append(row(f"error ({name})", "FAILED",
                            note=f"{type(error).__name__}: {error}"[:300]))
    if "engine" in checks:
        rows += engine_rows(model_dir)
    return rows, model_dir


def table(rows: list[dict]) -> str:
    lines = ["| check | status | value | note |", "|---|---|---:|---|"]
    lines += [f"| {r['check']} | {r['status']} | {r['value']} | {r['note']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--shape", default="full", choices=("full", "scaled"))
    parser.add_argument("--checks", type=parse_checks, default=tuple(PARTS),
                        help=f"comma-separated parts to run: {', '.join(PARTS)} (default: all)")
    args = parser.parse_args(argv)
    import torch

    if torch.cuda.is_available():
        rows, model_dir = gpu_rows(args.model_dir, args.shape, args.checks)
    else:
        rows = no_cuda_rows(f"no CUDA: torch {torch.__version__} sees no GPU")
        model_dir = args.model_dir
    if "sglang" in args.checks:
        rows.append(sglang_row(model_dir))
    rows = in_table_order(rows, args.checks)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(table(rows))
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
