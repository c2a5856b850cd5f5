"""Pass rate on bundled tasks: the tiny model, after an oracle warm start, after RL.

    python -m benchmarks.sft_pass_rate [--work DIR] [--num-tasks 8] [--num-sft-tasks 2]
                                       [--num-rounds 2] [--num-epochs 40] [--lr 3e-3]

Runs the commands a user would, one after another, each a subprocess of `undertow`:

1. `undertow model init` — the tiny model (about 4M parameters, random weights);
2. `undertow rollout` of the first N bundled tasks, 1 sample each, greedy
   (temperature 0), mini-swe-agent with a step limit of 3 — the *base* pass rate;
3. `undertow sft-collect` — the gold patch of each of the first `--num-sft-tasks` of
   them applied by the real mini-swe-agent through the gateway (replay engine), graded,
   into a tree store;
4. `undertow sft` on that store, in `--num-rounds` rounds of `--num-epochs` epochs,
   each round starting from the previous one's model (torch on one thread: the
   machine is shared), and after each round
5. the same rollout with the warm-started model;
6. `undertow train` from the warm-started model: the default two steps (group of 2,
   tasks 1 and 2 of the bundled set), with the evaluation's step and token limits;
7. the same rollout with the model of its last checkpoint.

The SFT tasks are among the evaluation tasks, and the first two are the tasks the RL
steps run: a 4M-parameter model can at best memorise the oracle turns of tasks it has
seen (and on this shared 2-core machine only of a few, in minutes), so this measures
what a warm start gives RL to start from, not generalisation. A stage whose output is
already in `--work` is not run again. Writes benchmarks/results/sft_pass_rate.json and
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "sft_pass_rate.json"
TASKS = "sandboxes/tasks/bundled"
EVAL_OPTIONS = ("scaffold_options.step_limit=3", "scaffold_options.temperature=0",
                "scaffold_options.max_tokens=768")


def run(argv: list[str], log: Path, env: dict | None = None) -> tuple[float, str]:
    """Runs `undertow ARGV`; returns its wall time and output; fails with its log."""
    command = [sys.executable, "-m", "undertow.cli", *argv]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {shlex.join(command)}; see {log}")
    return time.perf_counter() - started, result.stdout


def evaluate(work: Path, name: str, model_dir: Path, num_tasks: int) -> dict:
    out = work / f"eval-{name}"
    argv = ["rollout", "--tasks", TASKS, "--scaffold", "mini-swe-agent", "--model",
            str(model_dir), "--out", str(out), *EVAL_OPTIONS, f"num_tasks={num_tasks}",
            "concurrency=2", "timeout_s=300", "progress_interval_s=0"]
    done = sorted(out.glob("*/summary.json"))
    wall_s = None
    if not done:
        wall_s, _ = run(argv, work / f"eval-{name}.log")
        done = sorted(out.glob("*/summary.json"))
    summary = json.loads(done[-1].read_text())
    return {"model": name, "command": "undertow " + shlex.join(argv), "wall_s": wall_s,
            "rollout_s": summary["duration_s"], "num_sessions": summary["num_sessions"],
            "pass_rate": summary["pass_rate"], "mean_reward": summary["mean_reward"],
            "resolved": sorted(t["instance_id"] for t in summary["tasks"]
                               if t["pass_rate"] > 0)}


def warm_start(work: Path, base: Path, num_tasks: int, args) -> tuple[dict, list[dict]]:
    """Collects the oracle trajectories of the first `num_tasks` tasks, trains on them
    round by round; returns the record and the evaluations after each round."""
    store = work / "oracle-store"
    collect = ["sft-collect", "--tasks", TASKS, "--num-tasks", str(num_tasks), "--model",
               str(base), "--out", str(store), "--logs", str(work / "collect"),
               "--progress-interval-s", "0"]
    record = {"commands": ["undertow " + shlex.join(collect)], "rounds": []}
    if not any(store.glob("*.jsonl")):
        record["collect_s"], _ = run(collect, work / "collect.log")
    evals, model = [], base
    for number in range(1, args.num_rounds + 1):
        last = number == args.num_rounds
        out = work / ("warm" if last else f"warm-r{number}")
        sft = ["sft", "--store", str(store), "--model", str(model), "--out", str(out),
               f"sft.num_epochs={args.num_epochs}", f"sft.lr={args.lr}", "sft.min_reward=1"]
        if not (out / "model.safetensors").exists():
            run(sft, work / f"sft-r{number}.log", env={"OMP_NUM_THREADS": "1"})
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        record["commands"].append("OMP_NUM_THREADS=1 undertow " + shlex.join(sft))
        record["rounds"].append({
            "num_steps": len(metrics), "train_s": sum(m["train_s"] for m in metrics),
            "first_loss": metrics[0]["loss"],
            "last_epoch_mean_loss": statistics.fmean(m["loss"] for m in metrics[-num_tasks:])})
        evals.append(evaluate(work, "sft" if last else f"sft-r{number}", out, args.num_tasks))
        model = out
    return record, evals


def train(work: Path, warm: Path) -> tuple[dict, Path]:
    run_dir = work / "train"
    argv = ["train", "-c", "undertow/configs/swe.yaml", "--run-dir", str(run_dir),
            f"run.model_dir={warm}",
            "rollout.scaffold_options={step_limit: 3, max_tokens: 768}",
            "rollout.timeout_s=300"]
    wall_s = None
    if not (run_dir / "checkpoints").exists():
        wall_s, _ = run(argv, work / "train.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    from undertow.learner.checkpoint import latest_checkpoint

    return ({"command": "undertow " + shlex.join(argv), "wall_s": wall_s,
             "steps": [{k: r.get(k) for k in ("step", "reward_mean", "pass_rate", "loss",
                                              "num_sessions")} for r in records]},
            latest_checkpoint(run_dir) / "model")


def table(evals: list[dict]) -> str:
    lines = ["| model | sessions | pass rate | mean reward | rollout (s) | resolved |",
             "|---|---|---|---|---|---|"]
    for row in evals:
        lines.append(f"| {row['model']} | {row['num_sessions']} | {row['pass_rate']:.0%} | "
                     f"{row['mean_reward']:.2f} | {row['rollout_s']:.0f} | "
                     f"{', '.join(row['resolved']) or '-'} |")
    return "\n".join(lines)


def main(args) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not (base / "model.safetensors").exists():
        run(["model", "init", "--out", str(base), "--size", "tiny", "--seed", "0"],
            work / "init.log")
    evals = [evaluate(work, "base", base, args.num_tasks)]
    sft, sft_evals = warm_start(work, base, args.num_sft_tasks, args)
    evals += sft_evals
    trained, trained_model = train(work, work / "warm")
    evals.append(evaluate(work, "sft+rl2", trained_model, args.num_tasks))
    result = {"machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
              "num_tasks": args.num_tasks, "num_sft_tasks": args.num_sft_tasks,
              "evaluations": evals, "warm_start": sft,
              "train": trained}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(table(evals))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/sft-pass-rate"))
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--num-sft-tasks", type=int, default=2)
    parser.add_argument("--num-rounds", type=int, default=2)
    parser.add_argument("--num-epochs", type=int, default=40, help="per round")
    parser.add_argument("--lr", type=float, default=3e-3)
    main(parser.parse_args())
