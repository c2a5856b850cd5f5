"""Learning on SWE tasks, held out: pass rate on unseen instances as RL goes on.

    python -m benchmarks.learning --model qwen2.5-coder-0.5b-instruct [--work DIR]
        [--difficulty line] [--num-steps 24] [--eval-every 8] [--group-size 8]
        [--groups-per-step 4] [--rl-lr 3e-6] [--eval-sessions 150] [--concurrency 8]
    python -m benchmarks.learning --model tiny [--num-sft-tasks 60] [--sft-epochs 2] ...
    python -m benchmarks.learning --family explore --start sft [--num-sft-tasks 40]
        [--sft-lr 1e-5] [--sft-epochs 2] [--sft-mix 0.5] --num-steps 0 --eval-sessions 32 ...

`--model` is the start policy: a pretrained model directory, or the name of one that
`make setup-models` puts in .cache/models (`benchmarks.learner.MODELS`), trained by RL
straight from its weights; or `tiny`, random weights that first learn the oracle's two
tool-call turns by SFT. Each stage is a subprocess of `undertow`, the commands a user would
run, and is skipped when its output is already in `--work` (so an interrupted run resumes
where it stopped):

1. `python -m benchmarks.learning_tasks`: the generated task family (`learning_tasks.py`,
   at `--difficulty`), split by instance into `WORK/tasks/train` and `WORK/tasks/heldout`;
2. tiny, or a pretrained policy with `--start sft` (explore): `undertow model init` (tiny),
   `undertow sft-collect` on `--num-sft-tasks` training instances (tiny: the gold patch
   applied by the real mini-swe-agent; explore: the gold session of
   `explore_tasks.oracle_commands`, grep, read, sed, submit), `undertow sft`; with
   `--sft-mix` below 1, `benchmarks.weight_mix`: the start is that far from the base
   to the SFT (an SFT that samples one session per instance gives RL uniform groups);
3. `undertow rollout` on the held-out instances with the start policy: at least
   `--eval-sessions` sessions (each held-out instance `ceil(N / num held-out)` times;
   fewer sessions than instances: as many of each repository);
4. `undertow train` from it to the next held-out point (every `--eval-every` steps):
   mini-swe-agent sessions in Docker sandboxes on the training instances, then a
   checkpoint; each later segment goes on from it (`--resume`);
5. the held-out rollout of step 3 with that checkpoint, its weights kept as
   `WORK/models/rlSTEP` (hard links); back to 4 until `--num-steps`;
6. `undertow plot` of the RL run, and `heldout.png`: held-out pass rate per RL step with
   Wilson's 95% interval (`undertow/evaluation.py`) over the pooled held-out sessions, and
   the train/sample mismatch of every step (`metrics.jsonl`: mean and max over the trained
   tokens of |logprob(learner) - logprob(engine)|).

The scaffold is the real mini-swe-agent, unmodified. With a pretrained policy its prompts
are `configs/learning_mini_swe_agent.yaml` (short, text-based actions: the command is the
reply's ```bash block), `--step-limit` 1 call of at most `--max-tokens` 96; the tiny
model keeps mini-swe-agent's swebench.yaml and tool calls, which its SFT data holds, and 3
calls of 256 tokens.

Writes, after every held-out point, `benchmarks/results/learning.json` (every stage's
command, wall time and figures: per held-out point its sessions and Wilson interval, the
last point's difference from the start with Newcombe's interval; per RL step reward,
mismatch, masked fraction and times; reward variance of the RL groups) and
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

from benchmarks.explore_behaviour import behaviour
from benchmarks.explore_tasks import ORACLE_FILE, in_turn
from benchmarks.learner import resolve_model
from undertow.adapters.summary import ended_sessions
from undertow.evaluation import difference_interval, outcomes, wilson_interval

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "learning.json"
PLOT = REPO / "benchmarks" / "results" / "learning_heldout.png"
AGENT_CONFIG = REPO / "benchmarks" / "configs" / "learning_mini_swe_agent.yaml"
EXPLORE_CONFIG = REPO / "benchmarks" / "configs" / "explore_mini_swe_agent.yaml"
TINY = "tiny"
# The task families, by `--family`: the generator, where results go, and the settings a
# pretrained policy gets where the command line leaves them out. "explore": the statement
# shows a symptom only, so a session is many calls (find, read, edit): a step limit of 8
# calls of at most 96 tokens (a reply is one command), and a time limit that the slowest
# sessions reach on this loaded machine; a later call of a session may be sampled by newer
# weights (max_staleness 1).
FAMILIES = {
    "swe": {"module": "benchmarks.learning_tasks", "results": RESULTS, "plot": PLOT,
            "difficulty": "line", "splits": ("heldout",)},
    "explore": {"module": "benchmarks.explore_tasks",
                "results": REPO / "benchmarks" / "results" / "learning_explore.json",
                "plot": REPO / "benchmarks" / "results" / "learning_explore_heldout.png",
                "difficulty": "numbers", "splits": ("heldout", "heldout-seen"),
                "step_limit": 8, "max_tokens": 96, "agent_config": EXPLORE_CONFIG,
                "timeout_s": 600.0, "max_staleness": 1},
}
# Settings where the command line leaves them out, by start policy: the tiny model's SFT
# data is mini-swe-agent's stock tool-call format, two calls of ~195 tokens, and its head
# is its embedding; a pretrained policy's embedding and untied head stay as they are
# (learner.frozen: 3.3 GB less resident for Qwen2.5-Coder-0.5B, whose learner at 10.9 GB
# was OOM-killed twice here beside other work).
# SFT (the tiny model always; a pretrained one with `--start sft`): random weights need
# 3e-3 to learn two turns at all; a pretrained 0.5B model is pushed off its format by a
# tenth of that (RL at 1e-5 collapsed in one step), so it gets 1e-5 on fewer transcripts.
RUN_DEFAULTS = {TINY: {"step_limit": 3, "max_tokens": 256, "agent_config": None,
                       "frozen": "", "sft_lr": 3e-3, "num_sft_tasks": 60},
                "pretrained": {"step_limit": 1, "max_tokens": 96, "agent_config": AGENT_CONFIG,
                               "frozen": "model.embed_tokens,lm_head", "sft_lr": 1e-5,
                               "num_sft_tasks": 40}}
STEP_KEYS = ("step", "reward_mean", "reward_std", "pass_rate", "loss", "entropy", "grad_norm",
             "mismatch_mean", "mismatch_max", "ratio_p5", "ratio_p95", "masked_fraction",
             "num_sessions", "num_cut_sessions", "num_uniform_groups", "num_dropped_uniform",
             "num_trained_tokens", "num_unique_tokens", "step_s", "rollout_s", "train_s",
             "sync_s")


def run(argv: list[str], log: Path, module: str = "undertow.cli", num_threads: int = 1) -> dict:
    """Runs `python -m MODULE ARGV` with `num_threads` torch threads (its engine and
    learner); returns the command, its wall time and the load average before and after
    (also written beside its log, LOG.timing.json); exits with its log's path when it
    fails."""
    command = [sys.executable, "-m", module, *argv]
    print(f"$ {shlex.join(command[2:])}", flush=True)
    load, started = os.getloadavg()[0], time.perf_counter()
    with log.open("w") as out:
        result = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": str(num_threads)})
    if result.returncode != 0:
        raise SystemExit(f"failed ({result.returncode}): {shlex.join(command)}; see {log}")
    timing = {"command": shlex.join(["python", "-m", module, *argv]),
              "wall_s": time.perf_counter() - started,
              "load_average_1m": [load, os.getloadavg()[0]]}
    log.with_suffix(".timing.json").write_text(json.dumps(timing))
    return timing


def _timed(record: dict, name: str, argv: list[str], log: Path, done: bool,
           module: str = "undertow.cli", num_threads: int = 1) -> None:
    """Runs a stage, or (`done`) reads back the command and timing of the run that did it."""
    command = shlex.join(["python", "-m", module, *argv])
    timing_path = log.with_suffix(".timing.json")
    if not done:
        timing = run(argv, log, module, num_threads)
    elif timing_path.exists():
        timing = json.loads(timing_path.read_text())
    else:
        timing = {"wall_s": None}
    record[name] = {"command": command, "num_threads": num_threads, **timing}


def scaffold_options(args) -> dict:
    """mini-swe-agent's options (`adapters/mini_swe_agent.py`) for every session."""
    options = {"step_limit": args.step_limit, "max_tokens": args.max_tokens,
               "temperature": args.temperature}
    if args.agent_config:
        options["overrides"] = [str(Path(args.agent_config).resolve())]
    return options


def prepare(work: Path, args, record: dict) -> tuple[str, Path]:
    """Stages 1-2: the tasks, and the start policy: (its name, its directory)."""
    tasks = work / "tasks"
    family = FAMILIES[args.family]
    argv = ["--out", str(tasks), "--num-instances", str(args.num_instances),
            "--seed", str(args.seed), "--difficulty", args.difficulty]
    if args.family == "explore":
        argv += ["--num-unseen", str(args.num_unseen)]
    _timed(record, "tasks", argv, work / "tasks.log",
           all((tasks / split / "tasks.jsonl").exists() for split in family["splits"]),
           family["module"])
    if args.model == TINY:
        base = work / "base"
        _timed(record, "init", ["model", "init", "--out", str(base), "--size", "tiny",
                                "--seed", str(args.seed)], work / "init.log",
               (base / "model.safetensors").exists())
        return "sft", sft_model(work, args, record, base)
    if args.start == "sft":
        base = resolve_model(args.model)
        sft = sft_model(work, args, record, base)
        return ("sft", sft) if args.sft_mix == 1 else mixed_start(work, args, record, base, sft)
    return "start", resolve_model(args.model)


def mixed_start(work: Path, args, record: dict, base: Path, sft: Path) -> tuple[str, Path]:
    """Stage mix (`--sft-mix` below 1): the start policy part of the way from the base to
    its SFT (`benchmarks/weight_mix.py`), for an SFT that samples too narrowly for RL."""
    name = f"sft-mix{args.sft_mix:g}"
    out = work / name
    _timed(record, "mix", ["--base", str(base), "--tuned", str(sft), "--alpha",
                           str(args.sft_mix), "--out", str(out)], work / "mix.log",
           (out / "model.safetensors").exists(), "benchmarks.weight_mix")
    return name, out


def collect_argv(work: Path, base: Path, args) -> list[str]:
    """`undertow sft-collect` on `--num-sft-tasks` training instances (tiny: the first;
    explore: `spread_over_repositories`). The tiny model imitates the gold patch's two
    tool calls; a pretrained one (explore) the gold session that
    `explore_tasks.oracle_commands` wrote beside the tasks, as text actions, under the
    same prompts and limits its held-out sessions get."""
    train = work / "tasks" / "train"
    argv = ["sft-collect", "--tasks", str(train), "--model", str(base),
            "--out", str(work / "oracle-store"), "--logs", str(work / "collect"),
            "--concurrency", str(args.concurrency), "--timeout-s", str(args.timeout_s),
            "--progress-interval-s", "0"]
    if args.model == TINY:
        return argv + ["--num-tasks", str(args.num_sft_tasks)]
    for instance_id in spread_over_repositories(train / "tasks.jsonl", args.num_sft_tasks):
        argv += ["--task", instance_id]
    argv += ["--commands", str(train / ORACLE_FILE), "--step-limit", str(args.step_limit),
             "--max-tokens", str(args.max_tokens)]
    argv += ["--agent-config", str(Path(args.agent_config).resolve())] \
        if args.agent_config else []
    return argv


def spread_over_repositories(tasks_file: Path, num_tasks: int) -> list[str]:
    """The first `num_tasks` instance ids taken from each repository in turn. A split that
    lists a repository's instances together (as `explore_tasks` wrote them before it
    interleaved them) has one repository's first: an SFT on 8 ledger sessions learned to
    `cat ledger/api.py` in every repository, and a held-out point of the first 32 of 60
    was 26 `ledger` and 6 `orbit`."""
    records = [json.loads(line) for line in tasks_file.read_text().splitlines()]
    return [record["instance_id"] for record in in_turn(records, lambda r: r["repo"])
            ][:num_tasks]


def sft_argv(work: Path, base: Path, args) -> list[str]:
    """`undertow sft` from `base` on the collected sessions that resolved their task, the
    same parameters frozen as in RL (`--frozen`)."""
    argv = ["sft", "--store", str(work / "oracle-store"), "--model", str(base),
            "--out", str(work / "sft"), f"sft.num_epochs={args.sft_epochs}",
            f"sft.lr={args.sft_lr}", "sft.min_reward=1"]
    if args.frozen:
        argv.append(f"sft.frozen={json.dumps(args.frozen.split(','))}")
    return argv


def sft_model(work: Path, args, record: dict, base: Path) -> Path:
    """The SFT start policy: `base` trained on oracle sessions of training instances
    (stages collect and sft, each skipped when its output is in `work`)."""
    store, sft = work / "oracle-store", work / "sft"
    _timed(record, "collect", collect_argv(work, base, args), work / "collect.log",
           any(store.glob("*.jsonl")), num_threads=args.threads)
    _timed(record, "sft", sft_argv(work, base, args), work / "sft.log",
           (sft / "model.safetensors").exists(), num_threads=args.threads)
    rewards = [r for runs in group_rewards(store)["rewards"].values() for r in runs]
    record["collect"].update({"num_sessions": len(rewards),
                              "num_resolved": sum(r >= 1 for r in rewards)})
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


def eval_argv(heldout: Path, out: Path, model: Path, num_sessions: int, args) -> list[str]:
    """`undertow rollout` of `num_sessions` (at least 1) on the split `heldout`: each of
    its instances `ceil(N / number of instances)` times, or, when N is fewer, N of them
    taken from each repository in turn."""
    num_heldout = len((heldout / "tasks.jsonl").read_text().splitlines())
    num_tasks = min(num_heldout, max(num_sessions, 1))
    argv = ["rollout", "--tasks", str(heldout), "--scaffold", "mini-swe-agent", "--model",
            str(model), "--out", str(out)]
    if num_tasks < num_heldout:
        for instance_id in spread_over_repositories(heldout / "tasks.jsonl", num_tasks):
            argv += ["--task", instance_id]
    return argv + [f"num_tasks={num_tasks}",
                   f"group_size={math.ceil(max(num_sessions, 1) / num_tasks)}",
                   f"concurrency={args.concurrency}", f"timeout_s={args.timeout_s}",
                   "progress_interval_s=60",
                   f"scaffold_options={json.dumps(scaffold_options(args))}"]


def evaluate(work: Path, name: str, model: Path, args, split: str = "heldout") -> dict:
    """The held-out rollouts of `model` (stage 3/5) on `split`, at least `--eval-sessions`
    sessions in all, pooled pass rate and Wilson interval. Left out, and counted:
    sessions Undertow failed (`evaluation.outcomes`), and those that timed out before the
    scaffold made its first model call (mini-swe-agent still starting on a machine loaded
    by other work: the policy was never asked)."""
    heldout = work / "tasks" / split
    out = work / "eval" / (name if split == "heldout" else f"{name}-{split}")
    # A point is every rollout under `out`, pooled: an earlier, smaller point (a probe)
    # counts, and only the sessions it lacks are run.
    earlier = _summaries(out)
    num_missing = args.eval_sessions - sum(len(summary["sessions"]) for summary in earlier)
    argv = eval_argv(heldout, out, model, num_missing, args)
    row: dict = {}
    load = os.getloadavg()[0]
    # The log of the point's last rollout: the one run now, or (done) the one run last.
    num_runs = len(earlier) + (num_missing > 0)
    log = work / (f"eval-{out.name}.log" if num_runs <= 1 else f"eval-{out.name}-{num_runs}.log")
    _timed(row, "rollout", argv, log, num_missing <= 0, num_threads=args.threads)
    summaries = _summaries(out)
    summary = {"sessions": [s for one in summaries for s in one["sessions"]],
               "duration_s": sum(one["duration_s"] for one in summaries),
               "num_completion_tokens": sum(one["num_completion_tokens"] for one in summaries)}
    sessions = summary["sessions"]
    unanswered = [s for s in sessions if s["cause"] == "timeout" and not s["num_calls"]]
    per_task, num_failed = outcomes({"sessions": [s for s in sessions
                                                  if s not in unanswered]})
    results = [resolved for runs in per_task.values() for resolved in runs]
    return {"model": name, "split": split, **row["rollout"],
            "load_average_1m_at_start": load,
            "num_sessions": len(results), "num_left_out": num_failed + len(unanswered),
            "num_timed_out_unanswered": len(unanswered),
            "num_resolved": sum(results), "pass_rate": sum(results) / max(len(results), 1),
            "interval": wilson_interval(sum(results), len(results)),
            "num_tasks_resolved": sum(any(s) for s in per_task.values()),
            "rollout_s": summary["duration_s"], "num_rollouts": len(summaries),
            "session_s_mean": sum(s["duration_s"] for s in sessions) / len(sessions),
            "completion_tokens_mean": summary["num_completion_tokens"] / len(sessions),
            "completion_tokens_per_s": summary["num_completion_tokens"] / summary["duration_s"],
            "causes": _count(s["cause"] for s in sessions),
            "exit_statuses": _count(s.get("details", {}).get("exit_status", "")
                                    for s in sessions)}


def _summaries(out: Path) -> list[dict]:
    """The summary.json of every rollout under `out`, oldest first, each with only its
    sessions that ended: a point whose rollout was stopped part-way runs the rest again."""
    summaries = []
    for path in sorted(out.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        summary["sessions"] = ended_sessions(summary["sessions"])
        summaries.append(summary)
    return summaries


def _count(values) -> dict:
    counts: dict = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def train_argv(work: Path, start: Path, args, num_steps: int) -> list[str]:
    """`undertow train` on the training split from `start` to step `num_steps`
    (configs/swe.yaml, overridden), a checkpoint at each held-out point."""
    run_dir = work / "train"
    argv = ["train", "-c", "undertow/configs/swe.yaml", "--run-dir", str(run_dir),
            f"run.model_dir={start}", f"rollout.tasks={work / 'tasks' / 'train'}",
            f"rollout.scaffold_options={json.dumps(scaffold_options(args))}",
            f"rollout.concurrency={args.concurrency}",
            f"rollout.timeout_s={args.train_timeout_s or args.timeout_s}",
            f"learner.num_steps={num_steps}", f"learner.group_size={args.group_size}",
            f"learner.groups_per_step={args.groups_per_step}", f"learner.lr={args.rl_lr}",
            f"learner.max_staleness={args.max_staleness}",
            # Each held-out point is a segment's end, so always a checkpoint; between them,
            # every --checkpoint-every steps, so a killed run loses at most that many.
            f"learner.checkpoint_every={args.checkpoint_every}", "learner.keep_checkpoints=2",
            f"loss.correction={args.correction}",
            f"advantages.timeout_reward={args.cut_sessions}",
            f"advantages.filter_uniform_groups={str(args.filter_uniform).lower()}"]
    if args.model != TINY:
        argv.append("learner.activation_checkpointing=true")
    if args.frozen:
        argv.append(f"learner.frozen={json.dumps(args.frozen.split(','))}")
    return argv


def train_to(work: Path, start: Path, args, num_steps: int) -> dict:
    """Stage 4 up to step `num_steps`: `undertow train` from the start policy, or on from
    the run's latest checkpoint (`--resume`); nothing when that checkpoint is there."""
    argv = train_argv(work, start, args, num_steps)
    latest = _checkpoints(work / "train")
    if not latest and (work / "train").exists():
        print(f"{work / 'train'}: a first segment stopped before its first checkpoint; "
              "starting it over", flush=True)
        shutil.rmtree(work / "train")
    done = bool(latest) and latest[-1][0] >= num_steps
    if latest and not done:
        argv.append("--resume")
    record: dict = {}
    _timed(record, "train", argv, work / f"train-{num_steps:04d}.log", done,
           num_threads=args.threads)
    return {"to_step": num_steps, **record["train"]}


def eval_steps(args) -> list[int]:
    """The RL steps with a held-out point: every `--eval-every`, and the last."""
    return sorted({*range(args.eval_every, args.num_steps + 1, args.eval_every),
                   args.num_steps} - {0})


def point_model(work: Path, step: int) -> Path:
    """The weights of the held-out point at RL step `step`, kept as `models/rl{step}`:
    hard links to the step's checkpoint, which the run prunes later on
    (`learner.keep_checkpoints`). A point whose checkpoint was pruned before this was kept
    has no weights here; its rollouts, done, still count."""
    kept = work / "models" / f"rl{step}"
    checkpoint = dict(_checkpoints(work / "train")).get(step)
    if not kept.exists() and checkpoint is not None:
        shutil.copytree(checkpoint, kept, copy_function=os.link)
    return kept


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, model folder) of each checkpoint, oldest first; a later save at the same step
    (`step-000007.1`, written when a run is stopped right after one) sorts after it."""
    folder = run_dir / "checkpoints"
    found = [(tuple(int(part) for part in p.name.split("-")[1].split(".")), p / "model")
             for p in folder.glob("step-*")]
    return [(key[0], model) for key, model in sorted(found)]


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


def gain(evals: list[dict]) -> dict | None:
    """The last held-out point against the first: the difference of pass rates with
    Newcombe's 95% interval (independent samples: the sessions differ)."""
    if len(evals) < 2:
        return None
    first, last = evals[0], evals[-1]
    low, high = difference_interval(first["num_resolved"], first["num_sessions"],
                                    last["num_resolved"], last["num_sessions"])
    return {"from_step": first["rl_step"], "to_step": last["rl_step"],
            "difference": last["pass_rate"] - first["pass_rate"], "interval": [low, high],
            "excludes_zero": low > 0 or high < 0}


def plot_heldout(evals: list[dict], steps: list[dict], path: Path,
                 seen: list[dict] | None = None) -> Path:
    """Held-out pass rate per RL step with Wilson's 95% interval (and, with `seen`, that
    of the held-out instances of the training repositories); beside it, each step's
    train/sample mismatch (mean and max |logprob(learner) - logprob(engine)|)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (rates_axis, mismatch_axis) = pyplot.subplots(1, 2, figsize=(11, 3.8))
    for points, label in ((evals, "held out"), (seen or [], "held-out instances, seen repos")):
        if not points:
            continue
        rates = [e["pass_rate"] for e in points]
        errors = [[r - e["interval"][0] for r, e in zip(rates, points, strict=True)],
                  [e["interval"][1] - r for r, e in zip(rates, points, strict=True)]]
        fewest, most = (f(e["num_sessions"] for e in points) for f in (min, max))
        span = f"{fewest}" if fewest == most else f"{fewest}-{most}"
        rates_axis.errorbar([e["rl_step"] for e in points], rates, yerr=errors, marker="o",
                            capsize=4, label=f"{label} ({span} sessions a point)")
    rates_axis.set_xlabel(f"RL step (0: {evals[0]['model']})")
    rates_axis.set_ylabel("pass rate")
    rates_axis.set_ylim(-0.02, 1.02)
    rates_axis.grid(alpha=0.3)
    rates_axis.legend(fontsize=8)
    rates_axis.set_title("held-out pass rate, 95% Wilson")
    measured = [s for s in steps if s.get("mismatch_mean") is not None]
    if measured:
        numbers = [s["step"] for s in measured]
        mismatch_axis.plot(numbers, [s["mismatch_mean"] for s in measured], marker=".",
                           label="mean")
        mismatch_axis.plot(numbers, [s["mismatch_max"] for s in measured], marker=".",
                           label="max")
        mismatch_axis.set_yscale("log")
        mismatch_axis.legend()
    mismatch_axis.set_xlabel("RL step")
    mismatch_axis.set_ylabel("|logprob learner - engine| (nats)")
    mismatch_axis.grid(alpha=0.3)
    mismatch_axis.set_title("train/sample mismatch over the trained tokens")
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
    name, start = prepare(work, args, record)
    record["rl"] = {"segments": []}
    evals = [evaluate_point(work, record, name, start, args, 0, start)]
    write_results(work, record, evals, args)
    for step in eval_steps(args):  # train to each held-out point, then evaluate it
        record["rl"]["segments"].append(train_to(work, start, args, step))
        model = point_model(work, step)
        evals.append(evaluate_point(work, record, f"{name}+rl{step}", model, args, step,
                                    start))
        write_results(work, record, evals, args)
    if args.num_steps > 0:
        _timed(record, "plot", ["plot", str(work / "train")], work / "plot.log", False)
        write_results(work, record, evals, args)
    print(table(evals))
    if record["gain"]:
        low, high = record["gain"]["interval"]
        print(f"gain: {record['gain']['difference']:+.1%} (95% {low:+.1%} to {high:+.1%})")
    print(f"results: {args.results}; plot: {args.plot}")


def evaluate_point(work: Path, record: dict, name: str, model: Path, args, step: int,
                   start: Path) -> dict:
    """A held-out point at RL step `step`: the held-out split's figures (returned), and,
    with `--eval-seen-sessions`, the held-out instances of the training repositories
    (kept in record["evaluations_seen"]); each with what the agent did (`behaviour`,
    decoded with the start policy's tokenizer, which RL leaves as it is)."""
    point = {**evaluate(work, name, model, args), "rl_step": step}
    if args.family == "explore":
        point["behaviour"] = behaviour(work / "tasks" / "heldout", work / "eval" / name, start)
    if args.eval_seen_sessions:
        seen_args = argparse.Namespace(**{**vars(args),
                                          "eval_sessions": args.eval_seen_sessions})
        seen = {**evaluate(work, name, model, seen_args, "heldout-seen"), "rl_step": step}
        if args.family == "explore":
            seen["behaviour"] = behaviour(work / "tasks" / "heldout-seen",
                                          work / "eval" / f"{name}-heldout-seen", start)
        record.setdefault("evaluations_seen", [])
        record["evaluations_seen"] = [e for e in record["evaluations_seen"]
                                      if e["rl_step"] != step] + [seen]
    return point


def step_row(metrics: dict) -> dict:
    """A step's figures from its metrics.jsonl line, and the learner's speed: unique
    tokens (each packed once) per second of the step's training."""
    row = {k: metrics.get(k) for k in STEP_KEYS}
    if row["num_unique_tokens"] and row["train_s"]:
        row["learner_tokens_per_s"] = row["num_unique_tokens"] / row["train_s"]
    return row


def write_results(work: Path, record: dict, evals: list[dict], args) -> None:
    """learning.json and the plot as they stand (after each held-out point, so that a
    run cut short keeps what it measured)."""
    metrics = work / "train" / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.exists() else []
    record["rl"]["steps"] = [step_row(s) for s in steps]
    if (work / "train" / "store").is_dir():
        record["rl"]["groups"] = group_rewards(work / "train" / "store")
    record["evaluations"] = evals
    record["gain"] = gain(evals)
    args.results.parent.mkdir(exist_ok=True)
    args.results.write_text(json.dumps(record, indent=2))
    shutil.copyfile(plot_heldout(evals, record["rl"]["steps"], work / "heldout.png",
                                 record.get("evaluations_seen")),
                    args.plot)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                        help="start policy: a model directory, a name of benchmarks.learner."
                        "MODELS, or `tiny` (random weights + SFT)")
    parser.add_argument("--work", type=Path, default=None,
                        help="default runs/learning-MODEL (MODEL: the name or folder's name)")
    parser.add_argument("--family", default="swe", choices=list(FAMILIES),
                        help="swe: benchmarks/learning_tasks.py (the statement quotes the "
                        "fix); explore: benchmarks/explore_tasks.py (a symptom only)")
    parser.add_argument("--results", type=Path, default=None,
                        help="results JSON (its plot beside it, .png); default "
                        "benchmarks/results/learning.json or learning_explore.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-instances", type=int, default=300,
                        help="explore: of the three training repositories")
    parser.add_argument("--num-unseen", type=int, default=64,
                        help="explore: instances of the held-out repository")
    parser.add_argument("--difficulty", default=None,
                        help="learning_tasks.DIFFICULTIES (line, numbers or call; default "
                        "line) or explore_tasks.DIFFICULTIES (call, numbers or constant; default "
                        "numbers)")
    parser.add_argument("--start", default="base", choices=("base", "sft"),
                        help="a pretrained policy's start: its weights, or (explore) them "
                        "after SFT on gold sessions of training instances (tiny: always sft)")
    parser.add_argument("--num-sft-tasks", type=int, default=None,
                        help="training instances with an oracle session (default: tiny 60, "
                        "pretrained 40)")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--sft-lr", type=float, default=None,
                        help="default: tiny 3e-3, pretrained 1e-5")
    parser.add_argument("--sft-mix", type=float, default=1.0,
                        help="--start sft: the start is base + SFT_MIX * (sft - base) "
                        "(benchmarks/weight_mix.py; 1: the SFT itself)")
    parser.add_argument("--num-steps", type=int, default=24, help="RL steps (0: none)")
    parser.add_argument("--eval-every", type=int, default=8,
                        help="held-out point every N steps")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--rl-lr", type=float, default=3e-6)
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="learner.max_staleness (default 0; explore: 1)")
    parser.add_argument("--cut-sessions", default="partial_credit",
                        choices=("partial_credit", "tree_value", "drop"),
                        help="advantages.timeout_reward: the reward of a session cut by its "
                        "time limit (tree_value: adapters/tree_value.py's value of the tree; "
                        "drop: not trained, the arm to compare with)")
    parser.add_argument("--frozen", default="auto",
                        help="learner.frozen, comma-separated ('' trains every parameter)")
    parser.add_argument("--checkpoint-every", type=int, default=1,
                        help="a checkpoint (5.4 GB for Qwen, its head frozen) every N steps; "
                        "2 are kept")
    parser.add_argument("--correction", default="mis",
                        help="loss.correction (mis: IcePop's token mask)")
    parser.add_argument("--filter-uniform", action="store_true",
                        help="advantages.filter_uniform_groups (DAPO's dynamic sampling)")
    parser.add_argument("--eval-sessions", type=int, default=150, help="per held-out point")
    parser.add_argument("--eval-seen-sessions", type=int, default=None,
                        help="per held-out point, on held-out instances of the training "
                        "repositories (explore only; default 64)")
    parser.add_argument("--step-limit", type=int, default=None, help="mini-swe-agent calls")
    parser.add_argument("--max-tokens", type=int, default=None, help="per call")
    parser.add_argument("--agent-config", default="auto",
                        help="mini-swe-agent config merged last ('none': its swebench.yaml)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads of the engine and the learner (OMP_NUM_THREADS)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="per session; one call takes 10-60 s here, but mini-swe-agent's "
                        "start alone took over 300 s at load 40 (default 900; explore: 600)")
    parser.add_argument("--train-timeout-s", type=float, default=None,
                        help="per RL session, where it differs from --timeout-s: a limit "
                        "some sessions reach, for the --cut-sessions arms, while held-out "
                        "points keep a limit none reach (default: --timeout-s)")
    args = parser.parse_args(argv)
    family = FAMILIES[args.family]
    suffix = "" if args.family == "swe" else f"-{args.family}"
    args.work = args.work or Path("runs") / f"learning{suffix}-{Path(args.model).name}"
    args.results, args.plot = (family["results"], family["plot"]) if args.results is None \
        else (args.results, args.results.with_suffix(".png"))
    args.difficulty = args.difficulty or family["difficulty"]
    args.max_staleness = family.get("max_staleness", 0) if args.max_staleness is None \
        else args.max_staleness
    args.timeout_s = args.timeout_s or family.get("timeout_s", 900.0)
    args.eval_seen_sessions = (64 if args.family == "explore" else 0) \
        if args.eval_seen_sessions is None else args.eval_seen_sessions
    defaults = {**RUN_DEFAULTS[TINY if args.model == TINY else "pretrained"],
                **({} if args.model == TINY else family)}
    args.step_limit = args.step_limit or defaults["step_limit"]
    args.max_tokens = args.max_tokens or defaults["max_tokens"]
    args.agent_config = {"auto": defaults["agent_config"], "none": None}.get(
        args.agent_config, args.agent_config)
    args.frozen = defaults["frozen"] if args.frozen == "auto" else args.frozen
    args.sft_lr = args.sft_lr or defaults["sft_lr"]
    args.num_sft_tasks = args.num_sft_tasks or defaults["num_sft_tasks"]
    if args.start == "sft" and args.model != TINY and args.family != "explore":
        parser.error("--start sft: gold sessions exist for --family explore only "
                     "(explore_tasks.oracle_commands); the swe family starts from the weights")
    return args


if __name__ == "__main__":
    main(parse_args())
