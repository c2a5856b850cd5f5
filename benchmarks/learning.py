"""Learning on SWE tasks, held out: pass rate on unseen instances after SFT and during RL.

    python -m benchmarks.learning [--work DIR] [--size tiny] [--num-instances 300]
        [--num-sft-tasks 60] [--sft-epochs 2] [--num-steps 4] [--eval-every 2]
        [--group-size 4] [--groups-per-step 2] [--eval-sessions 50] [--concurrency 4]

Each stage is a subprocess of `undertow`, the commands a user would run, and is skipped
when its output is already in `--work` (so an interrupted run resumes where it stopped):

1. `python -m benchmarks.learning_tasks`: the generated task family (`learning_tasks.py`),
   split by instance into `WORK/tasks/train` and `WORK/tasks/heldout`;
2. `undertow model init --size SIZE`: random weights;
3. `undertow sft-collect` on the first `--num-sft-tasks` training instances: the gold
   patch applied by the real mini-swe-agent through the gateway, graded in Docker;
4. `undertow sft` on those trajectories (`--sft-epochs` epochs);
5. `undertow rollout` on the held-out instances with the SFT model: at least
   `--eval-sessions` sessions (each held-out instance `ceil(N / num held-out)` times);
6. `undertow train` from the SFT model: mini-swe-agent sessions in Docker sandboxes on the
   training instances, a checkpoint every `--eval-every` steps (`--resume` when some exist);
7. the held-out rollout of step 5 with each checkpoint;
8. `undertow plot` of the RL run, and `heldout.png`: held-out pass rate per RL step with
   Wilson's 95% interval (`undertow/evaluation.py`) over the pooled held-out sessions.

Writes `benchmarks/results/learning.json` (every stage's command, wall time and figures:
seconds per session, per RL step, per SFT epoch; reward variance of the RL groups) and
`benchmarks/results/learning_heldout.png`, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from undertow.evaluation import outcomes, wilson_interval

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "learning.json"
PLOT = REPO / "benchmarks" / "results" / "learning_heldout.png"


def run(argv: list[str], log: Path, module: str = "undertow.cli") -> float:
    """Runs `python -m MODULE ARGV` (one thread for torch: the machine is shared);
    returns its wall time; exits with its log's path when it fails."""
    command = [sys.executable, "-m", module, *argv]
    print(f"$ {shlex.join(command[2:])}", flush=True)
    started = time.perf_counter()
    with log.open("w") as out:
        result = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {shlex.join(command)}; see {log}")
    return time.perf_counter() - started


def _timed(record: dict, name: str, argv: list[str], log: Path, done: bool,
           module: str = "undertow.cli") -> None:
    record[name] = {"command": shlex.join(["python", "-m", module, *argv]),
                    "wall_s": None if done else run(argv, log, module)}


def scaffold_options(args) -> list[str]:
    return [f"step_limit={args.step_limit}", f"max_tokens={args.max_tokens}",
            f"temperature={args.temperature}"]


def prepare(work: Path, args, record: dict) -> Path:
    """Stages 1-4: tasks, base model, oracle trajectories, SFT; returns the SFT model."""
    tasks, base, store, sft = (work / "tasks", work / "base", work / "oracle-store",
                               work / "sft")
    _timed(record, "tasks", ["--out", str(tasks), "--num-instances", str(args.num_instances),
                             "--seed", str(args.seed)], work / "tasks.log",
           (tasks / "heldout" / "tasks.jsonl").exists(), "benchmarks.learning_tasks")
    _timed(record, "init", ["model", "init", "--out", str(base), "--size", args.size,
                            "--seed", str(args.seed)], work / "init.log",
           (base / "model.safetensors").exists())
    _timed(record, "collect", [
        "sft-collect", "--tasks", str(tasks / "train"), "--num-tasks", str(args.num_sft_tasks),
        "--model", str(base), "--out", str(store), "--logs", str(work / "collect"),
        "--concurrency", str(args.concurrency), "--progress-interval-s", "0"],
        work / "collect.log", any(store.glob("*.jsonl")))
    _timed(record, "sft", [
        "sft", "--store", str(store), "--model", str(base), "--out", str(sft),
        f"sft.num_epochs={args.sft_epochs}", f"sft.lr={args.sft_lr}", "sft.min_reward=1"],
        work / "sft.log", (sft / "model.safetensors").exists())
    metrics = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = len(metrics) // args.sft_epochs
    record["sft"].update({
        "num_steps": len(metrics), "num_epochs": args.sft_epochs,
        "epoch_train_s": [sum(m["train_s"] for m in metrics[i:i + steps_per_epoch])
                          for i in range(0, len(metrics), steps_per_epoch)],
        "first_loss": metrics[0]["loss"],
        "last_epoch_mean_loss": sum(m["loss"] for m in metrics[-steps_per_epoch:])
        / steps_per_epoch})
    return sft


def evaluate(work: Path, name: str, model: Path, args) -> dict:
    """The held-out rollout of `model` (stage 5/7), pooled pass rate and Wilson interval."""
    heldout = work / "tasks" / "heldout"
    num_heldout = len((heldout / "tasks.jsonl").read_text().splitlines())
    num_tasks = min(num_heldout, args.eval_sessions)
    group_size = math.ceil(args.eval_sessions / num_tasks)
    out = work / "eval" / name
    argv = ["rollout", "--tasks", str(heldout), "--scaffold", "mini-swe-agent", "--model",
            str(model), "--out", str(out), f"num_tasks={num_tasks}", f"group_size={group_size}",
            f"concurrency={args.concurrency}", f"timeout_s={args.timeout_s}",
            "progress_interval_s=0",
            *(f"scaffold_options.{option}" for option in scaffold_options(args))]
    row: dict = {}
    _timed(row, "rollout", argv, work / f"eval-{name}.log", any(out.glob("*/summary.json")))
    summary = json.loads(sorted(out.glob("*/summary.json"))[-1].read_text())
    per_task, num_left_out = outcomes(summary)
    results = [resolved for sessions in per_task.values() for resolved in sessions]
    sessions = summary["sessions"]
    return {"model": name, **row["rollout"], "num_sessions": len(results),
            "num_left_out": num_left_out, "num_resolved": sum(results),
            "pass_rate": sum(results) / max(len(results), 1),
            "interval": wilson_interval(sum(results), len(results)),
            "num_tasks_resolved": sum(any(s) for s in per_task.values()),
            "rollout_s": summary["duration_s"],
            "session_s_mean": sum(s["duration_s"] for s in sessions) / len(sessions),
            "completion_tokens_mean": summary["num_completion_tokens"] / len(sessions),
            "causes": _count(s["cause"] for s in sessions)}


def _count(values) -> dict:
    counts: dict = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def train(work: Path, sft: Path, args) -> dict:
    """Stage 6: `undertow train` from the SFT model (resumed when it has checkpoints)."""
    run_dir = work / "train"
    options = "{" + ", ".join(o.replace("=", ": ") for o in scaffold_options(args)) + "}"
    argv = ["train", "-c", "undertow/configs/swe.yaml", "--run-dir", str(run_dir),
            f"run.model_dir={sft}", f"rollout.tasks={work / 'tasks' / 'train'}",
            f"rollout.scaffold_options={options}", f"rollout.concurrency={args.concurrency}",
            f"rollout.timeout_s={args.timeout_s}", f"learner.num_steps={args.num_steps}",
            f"learner.group_size={args.group_size}",
            f"learner.groups_per_step={args.groups_per_step}", f"learner.lr={args.rl_lr}",
            f"learner.checkpoint_every={args.eval_every}",
            f"learner.keep_checkpoints={args.num_steps // args.eval_every + 1}",
            f"advantages.filter_uniform_groups={str(args.filter_uniform).lower()}"]
    latest = _checkpoints(run_dir)
    done = bool(latest) and latest[-1][0] >= args.num_steps
    if latest and not done:
        argv.append("--resume")
    record: dict = {}
    _timed(record, "train", argv, work / "train.log", done)
    metrics_path = run_dir / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    record["train"]["steps"] = [
        {k: s.get(k) for k in ("step", "reward_mean", "reward_std", "pass_rate", "loss",
                               "num_sessions", "num_dropped_uniform", "step_s", "rollout_s",
                               "train_s", "sync_s")} for s in steps]
    record["train"]["groups"] = group_rewards(run_dir / "store")
    return record["train"]


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    folder = run_dir / "checkpoints"
    found = [(int(p.name.split("-")[1]), p / "model") for p in folder.glob("step-*")]
    return sorted(found) if folder.is_dir() else []


def group_rewards(store: Path) -> dict:
    """Per RL group, its valid sessions' rewards; how many groups had any variance
    (under group-relative advantages a group without variance trains nothing)."""
    from undertow.learner.trees import load_store_trees

    groups = {}
    for tree in load_store_trees(store):
        groups[tree.group_id] = [paths.reward for paths in tree.sessions.values()
                                 if paths.closed and not paths.meta.get("infra_failure")]
    return {"rewards": groups, "num_groups": len(groups),
            "num_with_variance": sum(len(set(r)) > 1 for r in groups.values())}


def plot_heldout(evals: list[dict], path: Path) -> Path:
    """Held-out pass rate per RL step (0 = after SFT) with Wilson's 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    steps = [e["rl_step"] for e in evals]
    rates = [e["pass_rate"] for e in evals]
    errors = [[r - e["interval"][0] for r, e in zip(rates, evals, strict=True)],
              [e["interval"][1] - r for r, e in zip(rates, evals, strict=True)]]
    figure, axis = pyplot.subplots(figsize=(6, 3.5))
    axis.errorbar(steps, rates, yerr=errors, marker="o", capsize=4)
    axis.set_xlabel("RL step (0: after SFT)")
    axis.set_ylabel("held-out pass rate")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.set_title(f"held-out pass rate, {evals[0]['num_sessions']} sessions a point, 95% CI")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


def table(evals: list[dict]) -> str:
    lines = ["| model | RL step | held-out sessions | resolved | pass rate | 95% Wilson | "
             "mean session (s) | rollout (s) |", "|---|---|---|---|---|---|---|---|"]
    for e in evals:
        low, high = e["interval"]
        lines.append(f"| {e['model']} | {e['rl_step']} | {e['num_sessions']} | "
                     f"{e['num_resolved']} | {e['pass_rate']:.1%} | {low:.1%}-{high:.1%} | "
                     f"{e['session_s_mean']:.1f} | {e['rollout_s']:.0f} |")
    return "\n".join(lines)


def main(args) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    record: dict = {"machine": {"cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
                    "args": {k: str(v) for k, v in vars(args).items()}}
    sft = prepare(work, args, record)
    evals = [{**evaluate(work, "sft", sft, args), "rl_step": 0}]
    if args.num_steps > 0:
        record["rl"] = train(work, sft, args)
        for step, model in _checkpoints(work / "train"):
            if step <= args.num_steps and (step % args.eval_every == 0
                                           or step == args.num_steps):
                evals.append({**evaluate(work, f"sft+rl{step}", model, args), "rl_step": step})
        _timed(record, "plot", ["plot", str(work / "train")], work / "plot.log", False)
    record["evaluations"] = evals
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=2))
    shutil.copyfile(plot_heldout(evals, work / "heldout.png"), PLOT)
    print(table(evals))
    print(f"results: {RESULTS}; plot: {PLOT}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/learning"))
    parser.add_argument("--size", default="tiny", help="`undertow model init --size`")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-instances", type=int, default=300)
    parser.add_argument("--num-sft-tasks", type=int, default=60,
                        help="training instances with an oracle trajectory")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--num-steps", type=int, default=4, help="RL steps (0: SFT only)")
    parser.add_argument("--eval-every", type=int, default=2, help="held-out point every N steps")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--filter-uniform", action="store_true",
                        help="advantages.filter_uniform_groups (DAPO's dynamic sampling)")
    parser.add_argument("--eval-sessions", type=int, default=50, help="per held-out point")
    parser.add_argument("--step-limit", type=int, default=3, help="mini-swe-agent calls")
    parser.add_argument("--max-tokens", type=int, default=256, help="per call")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
