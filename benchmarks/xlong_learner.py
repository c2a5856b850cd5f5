"""Part (b) of `benchmarks.xlong`: the learner's peak memory and time for one step, the LM
head chunked (with long micro-batches in segments) and unchunked, side by side.

Three cases, each variant in a FRESH subprocess (tiny model, fp32, one torch thread):

- `group`: one step over a group of sessions shaped like part (a)'s, scaled to this
  CPU: 2 sessions of 60 calls (~50-token completions, ~200-token observations), each
  condensed every 15 calls (history rewritten to the task plus a summary), so each has
  4 branches; packed with `max_tokens` 8192.
- `path`: one session's single path of `--path-tokens` tokens (15% of them sampled:
  150-token completions between 850-token observations), packed whole
  (`long_paths="whole"`): the chunked variants score it in segments of 8192 positions
  reusing the earlier segments' keys and values (`chunked+ckpt` with activation
  checkpointing too); the unchunked one runs it at once with the full (N, V) head, as
  before this change.
- `head`: the LM head alone (loss on logprobs and entropy, then backward) at the shape
  of a 128k-token path with 15% sampled: N = 19,660 scored positions, V = the tiny
  model's vocabulary, from random hidden states.

Reported per run: CPU and wall seconds of the step (loss, forward and backward), and
peak_step_mib = ru_maxrss after the step minus before it (how far the step pushed the
process's peak resident memory above the model, data and a warm-up step).

A fourth case, `long` (`run_long`), is the `path` case at `--long-path-tokens` (128k by
default): the chunked variant measured at that length, the unchunked one only where its
peak fits under `--max-rss-gib` (12 GiB: the machine's 24 GB are shared); else it is
measured on two shorter paths (`--probe-tokens`; 3/16 and 6/16 of the length: 24k and
48k for 128k) and extrapolated (`extrapolate`): its peak is linear in the path's tokens
(activations, flash attention's log-sum-exp and the (N, V) head all grow with T; chunked,
the segment's activations are fixed and the key/value store grows with T), its CPU
seconds a*T + b*T^2 (attention is quadratic), each fitted through the two points; wall
seconds are not extrapolated (on a shared machine they follow its load).
`--long-measure probes` extrapolates both variants so, for a machine with no half hour
of CPU per variant to spare.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

MAX_TOKENS = 8192
HEAD_CHUNK_TOKENS = 1024
PATH_SAMPLED_FRACTION = 0.15
HEAD_SHAPE_TOKENS = 131072
GROUP = {"sessions": 2, "calls": 60, "condense_every": 15, "task": 500, "summary": 300,
         "completion": 50, "observation": 200}
VARIANTS = {"unchunked": {"head_chunk_tokens": 0, "max_segment_tokens": 0},
            "chunked": {"head_chunk_tokens": HEAD_CHUNK_TOKENS, "max_segment_tokens": MAX_TOKENS},
            "chunked+ckpt": {"head_chunk_tokens": HEAD_CHUNK_TOKENS,
                             "max_segment_tokens": MAX_TOKENS, "activation_checkpointing": True}}
CASES = {"group": ("unchunked", "chunked"), "path": ("unchunked", "chunked", "chunked+ckpt"),
         "head": ("unchunked", "chunked")}


def _ids(rng: random.Random, num: int) -> list[int]:
    return [rng.randrange(6000) for _ in range(num)]


def group_tree(seed: int = 0):
    """Part (a)'s sessions at CPU scale: a shared task, growing histories, condensed."""
    from undertow.gateway.trees.tree import Tree

    rng = random.Random(seed)
    tree = Tree("xlong")
    task = _ids(rng, GROUP["task"])
    for index in range(GROUP["sessions"]):
        session_id = f"s{index}"
        prompt = list(task)
        for call in range(GROUP["calls"]):
            if call and call % GROUP["condense_every"] == 0:
                prompt = task + _ids(rng, GROUP["summary"])
            completion = _ids(rng, GROUP["completion"])
            tree.add_call(f"{session_id}-{call}", session_id, prompt, completion,
                          [rng.uniform(-9.5, -8.0) for _ in completion], [0] * len(completion))
            prompt = prompt + completion + _ids(rng, GROUP["observation"])
        tree.close_session(session_id, reward=float(index % 2))
    return tree


def path_tree(num_tokens: int, seed: int = 0):
    """One session whose single path has `num_tokens` tokens, 15% sampled."""
    from undertow.gateway.trees.tree import Tree

    rng = random.Random(seed)
    tree = Tree("xlong-path")
    completion_len = int(1000 * PATH_SAMPLED_FRACTION)
    prompt = _ids(rng, 1000 - completion_len)
    call = 0
    while len(prompt) + completion_len <= num_tokens:
        completion = _ids(rng, completion_len)
        tree.add_call(f"c{call}", "s0", prompt, completion,
                      [rng.uniform(-9.5, -8.0) for _ in completion], [0] * len(completion))
        prompt = prompt + completion + _ids(rng, 1000 - completion_len)
        call += 1
    tree.close_session("s0", reward=1.0)
    return tree


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(run) -> dict:
    before = _maxrss_mib()
    start, start_cpu = time.perf_counter(), time.process_time()
    value = run()
    return {"step_s": time.perf_counter() - start, "step_cpu_s": time.process_time() - start_cpu,
            "peak_step_mib": _maxrss_mib() - before, "loss": value}


def run_worker(case: str, variant: str, model_dir: str, path_tokens: int) -> dict:
    import torch

    from undertow.learner.model import PolicyModel

    torch.set_num_threads(1)
    policy = PolicyModel.load(model_dir, **VARIANTS[variant])
    warm_up = policy.score_path(torch.arange(16), torch.arange(1, 16), with_entropy=True)
    (warm_up.logprobs.sum() + warm_up.entropy.sum()).backward()
    policy.model.zero_grad(set_to_none=True)
    result = {"case": case, "variant": variant}
    if case == "head":
        return {**result, **_head_step(policy, variant)}
    tree = group_tree() if case == "group" else path_tree(path_tokens)
    return {**result, **_tree_step(policy, tree)}


def _tree_step(policy, tree) -> dict:
    from undertow.learner.advantages import group_advantages
    from undertow.learner.config import AdvantageConfig, LossConfig
    from undertow.learner.objective import backward_step
    from undertow.learner.packing import pack_step

    advantages = {(tree.group_id, s): a
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    if not any(advantages.values()):
        advantages = {key: 1.0 for key in advantages}
    step = pack_step([tree], advantages, MAX_TOKENS, long_paths="whole")
    config = LossConfig(name="token_mean", entropy_coef=0.01)
    measured = _measure(lambda: backward_step(policy, step, config)["loss"])
    return {**measured, **_step_counts(step)}


def _head_step(policy, variant: str) -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    head = policy.model.get_output_embeddings()
    num_rows = int(HEAD_SHAPE_TOKENS * PATH_SAMPLED_FRACTION)
    hidden = torch.randn(num_rows, head.in_features, generator=generator, requires_grad=True)
    targets = torch.randint(0, head.out_features, (num_rows,), generator=generator)

    def run():
        logprobs, entropy = policy.score_hidden(hidden, targets, True)
        loss = logprobs.mean() + 0.01 * entropy.mean()
        loss.backward()
        return float(loss)

    return {**_measure(run), "num_terms": num_rows, "vocab_size": head.out_features}


def run_all(model_dir: Path, path_tokens: int, timeout_s: int) -> list[dict]:
    return [_run_worker(case, variant, model_dir, path_tokens, timeout_s)
            for case, variants in CASES.items() for variant in variants]


def _run_worker(case: str, variant: str, model_dir: Path, path_tokens: int,
                timeout_s: int) -> dict:
    """One case and variant in a fresh process; its result row."""
    command = [sys.executable, "-m", "benchmarks.xlong", "--worker", case,
               "--variant", variant, "--model-dir", str(model_dir),
               "--path-tokens", str(path_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"{case}/{variant} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  {json.dumps(row)}", flush=True)
    return row


def probe_tokens(long_tokens: int) -> tuple[int, int]:
    """The two shorter paths a variant is extrapolated from."""
    return long_tokens * 3 // 16, long_tokens * 6 // 16


def run_long(model_dir: Path, long_tokens: int, timeout_s: int, max_rss_gib: float,
             probes: tuple[int, int] | None = None, measure: str = "full") -> list[dict]:
    """One step over a single `long_tokens` path. `measure` "full": chunked measured at
    that length, unchunked too if its extrapolated peak fits in `max_rss_gib`, else
    extrapolated from `probes`; "probes": both extrapolated from `probes` (for a machine
    with no half hour of CPU to spare)."""
    probes = probes or probe_tokens(long_tokens)
    measured = {variant: [_run_worker("path", variant, model_dir, tokens, timeout_s)
                          for tokens in probes]
                for variant in (("unchunked",) if measure == "full" else LONG_VARIANTS)}
    if measure == "full":
        measured["chunked"] = _run_worker("path", "chunked", model_dir, long_tokens, timeout_s)
    return long_rows(long_tokens, measured, max_rss_gib, model_dir, timeout_s)


LONG_VARIANTS = ("unchunked", "chunked")


def long_rows(long_tokens: int, measured: dict[str, dict | list[dict]], max_rss_gib: float,
              model_dir: Path | None = None, timeout_s: int = 0) -> list[dict]:
    """The long-path rows: per variant its row at `long_tokens` if measured (a dict),
    else its two probe rows (a list), extrapolated; the unchunked one is measured at
    full length (in `model_dir`) when extrapolated to fit in `max_rss_gib`."""
    case = f"path {long_tokens // 1024}k"
    full = [row for row in measured.values() if isinstance(row, dict)]
    counts = _counts_of(full[0]) if full else path_counts(long_tokens)
    rows, probe_rows = [], []
    for variant in LONG_VARIANTS:
        row = measured[variant]
        if isinstance(row, list):
            probe_rows += [{**r, "case": f"path {r['num_packed_tokens'] // 1000}k (probe)"}
                           for r in row]
            row = extrapolate(row, counts)
            if (variant == "unchunked" and full and model_dir is not None
                    and row["peak_step_mib"] <= max_rss_gib * 1024):
                row = _run_worker("path", variant, model_dir, long_tokens, timeout_s)
        rows.append({**row, "case": case})
    return probe_rows + rows


COUNTS = ("num_unique_tokens", "num_packed_tokens", "num_terms", "num_micro_batches",
          "longest_micro_batch")


def _counts_of(row: dict) -> dict:
    return {key: row[key] for key in COUNTS}


def path_counts(num_tokens: int) -> dict:
    """The packing counts of the `num_tokens` path (no model run)."""
    from undertow.learner.packing import pack_step

    tree = path_tree(num_tokens)
    step = pack_step([tree], {(tree.group_id, "s0"): 1.0}, MAX_TOKENS, long_paths="whole")
    return _step_counts(step)


def _step_counts(step) -> dict:
    return {"num_unique_tokens": step.num_unique_tokens,
            "num_packed_tokens": step.num_packed_tokens, "num_terms": step.num_terms,
            "num_micro_batches": len(step.micro_batches),
            "longest_micro_batch": max(mb.num_tokens for mb in step.micro_batches)}


def extrapolate(probes: list[dict], counts: dict) -> dict:
    """A variant's row at the path of `counts` from its two shorter measured rows: peak
    linear in the packed tokens T, CPU seconds a*T + b*T^2 (wall seconds: None)."""
    (t1, t2), length = [row["num_packed_tokens"] for row in probes], counts["num_packed_tokens"]
    first, second = probes
    row = _counts_of(counts)
    slope = (second["peak_step_mib"] - first["peak_step_mib"]) / (t2 - t1)
    row["peak_step_mib"] = second["peak_step_mib"] + slope * (length - t2)
    # a*T + b*T^2 through (t1, y1) and (t2, y2): y/T is linear in T. Not the wall seconds,
    # which follow the machine's load as much as the path.
    per_token = (second["step_cpu_s"] / t2 - first["step_cpu_s"] / t1) / (t2 - t1)
    row["step_cpu_s"] = length * (second["step_cpu_s"] / t2 + per_token * (length - t2))
    return {**row, "step_s": None, "variant": first["variant"], "extrapolated_from": [t1, t2]}


def worker_main(case: str, variant: str, model_dir: str, path_tokens: int) -> None:
    print(json.dumps(run_worker(case, variant, model_dir, path_tokens)))
