"""Live elastic benchmark: `undertow train` on CPU cells, elastic versus a fixed split (and
colocate), the same steps and samples, wall time side by side.

    python -m benchmarks.live_elastic [--policies split,elastic,elastic-async,colocate]
                                      [--num-steps 3] [--groups-per-step 3]

Each policy is one real `undertow train` process with a `pool` section: `--num-cells`
cells of one thread each, each rollout cell one built-in engine (tiny model) behind the
embedded gateway, each training cell one learner member process (gloo). The rollouts are
`tests/e2e/paced_rollouts.py` (through `make_run_group` below): per step
`--groups-per-step` groups of `--group-size` sessions, each `--num-turns` chat turns of
`--max-tokens` tokens, every turn followed by a scripted "tool" pause; one session of the
step's last group pauses `--slow-s` and all the others `--fast-s`, so that one session in
every batch is far slower than the rest (a long tail) while the other groups complete
early and stream into the open training step. `split` keeps
`--num-training-cells` cells training, with staleness 1 (asynchronous); `elastic` and
`colocate` are synchronous (staleness 0), `elastic-async` is elastic with staleness 1
(the next step's sessions start while the tail of the current one runs). A `-resident`
suffix (e.g. `elastic-resident`) sets `pool.resident_members`: a cell's learner member
process stays alive while the cell serves, so a move to training skips the member's
process start and model load.

Reported per policy: `total_s` (the command's wall time, engine start-up included),
`steps_s` (first dispatch to last publish, from the run's `pool_timeline.jsonl`), the
mean step, rollout and train times from `metrics.jsonl` (train: from the step's last
group to the optimizer step, i.e. what training adds after the rollout tail; the time
the step was open, streaming earlier groups, is `open_s_per_step`), how many role moves it made
and their mean time (to training: drain with migration + stop the engine; to rollout:
stop the member + start an engine + add it; when several cells return at once their
engines are started together first, `prepare_engines_s` in the JSON, not in the
per-move time), the members per step, and per step the micro-batches of groups that
were added to the open step while another of its groups still ran (streamed during the
tail) out of all its micro-batches. Ratios are split's (and colocate's) `steps_s` over elastic's.
JSON goes to `benchmarks/results/live_elastic.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "live_elastic.json"
SOURCE = "benchmarks.live_elastic:make_run_group"


def make_run_group(context):
    """The paced rollouts with latencies per session of the step: option
    `step_latency_s` lists them in launch order, and group i takes the slice of its
    position in the step (i mod `groups_per_step`) as its `tool_latency_s`."""
    from tests.e2e.paced_rollouts import make_run_group as paced_run_group

    options = dict(context.rollout.scaffold_options)
    latencies_s, groups_per_step = options.pop("step_latency_s"), options.pop("groups_per_step")
    group_size = len(latencies_s) // groups_per_step
    by_position = []
    for position in range(groups_per_step):
        mine = latencies_s[position * group_size:(position + 1) * group_size]
        rollout = dataclasses.replace(context.rollout,
                                      scaffold_options={**options, "tool_latency_s": mine})
        by_position.append(paced_run_group(dataclasses.replace(context, rollout=rollout)))

    async def run_group(request) -> str:
        return await by_position[request.index % groups_per_step](request)
    return run_group


def run_policy(policy: str, args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    run_dir = work / policy
    name, _, variant = policy.partition("-")
    num_sessions = args.groups_per_step * args.group_size
    latencies = [args.fast_s] * (num_sessions - 1) + [args.slow_s]
    command = [sys.executable, "-m", "undertow.cli", "train", "--run-dir", str(run_dir),
               f"run.model_dir={model_dir}", f"learner.num_steps={args.num_steps}",
               f"learner.groups_per_step={args.groups_per_step}",
               f"learner.group_size={args.group_size}",
               "learner.lr=0.001", f"rollout.source={SOURCE}",
               f"rollout.scaffold_options={{num_turns: {args.num_turns}, "
               f"max_tokens: {args.max_tokens}, step_latency_s: {latencies}, "
               f"groups_per_step: {args.groups_per_step}}}",
               f"pool.policy={name}", f"pool.num_cells={args.num_cells}",
               f"pool.resident_members={str(variant == 'resident').lower()}",
               f"pool.num_session_slots={args.num_session_slots}",
               f"pool.num_training_cells={args.num_training_cells}"]
    if name == "split" or variant == "async":
        command += ["pool.max_staleness=1", "learner.max_staleness=1"]
    else:
        command.append("learner.max_staleness=0")
    started_s = time.perf_counter()
    with open(work / f"{policy}.log", "wb") as log:
        code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              timeout=args.timeout_s).returncode
    total_s = time.perf_counter() - started_s
    if code != 0:
        raise RuntimeError(f"{policy}: undertow train exited {code}; see {work}/{policy}.log")
    return summarize(policy, run_dir, total_s)


def summarize(policy: str, run_dir: Path, total_s: float) -> dict:
    from undertow.cells.loop import read_timeline
    from undertow.learner.metrics_log import read_metrics

    events, records = read_timeline(run_dir), read_metrics(run_dir)
    first = next(e["begun_s"] for e in events if e["event"] == "DispatchBatch")
    last = [e["t_s"] for e in events if e["event"] == "published"][-1]

    def moves(kind: str) -> list[float]:
        return [e["t_s"] - e["begun_s"] for e in events if e["event"] == kind]

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 2) if values else None

    published = [e for e in events if e["event"] == "published"]
    early = [sum(e["num_micro_batches"] for e in events if e["event"] == "GroupAdded"
                 and e["step"] == p["step"] and e["num_groups_running"] > 0) for p in published]

    return {"policy": policy, "total_s": round(total_s, 1), "steps_s": round(last - first, 1),
            "step_s": mean([r["step_s"] for r in records]),
            "rollout_s": mean([r["rollout_s"] for r in records]),
            "train_s": mean([r["train_s"] for r in records]),
            "num_to_training": len(moves("MoveToTraining")),
            "to_training_s": mean(moves("MoveToTraining")),
            "num_to_rollout": len(moves("MoveToRollout")),
            "to_rollout_s": mean(moves("MoveToRollout")),
            "prepare_engines_s": round(sum(moves("PrepareEngines")), 2),
            "members_per_step": [r["num_members"] for r in records],
            "streamed_micro_batches_per_step": early,
            "micro_batches_per_step": [p["num_micro_batches"] for p in published],
            "open_s_per_step": [p["open_s"] for p in published],
            "drain_s_per_step": [p["drain_s"] for p in published],
            "reduce_s_per_step": [p["reduce_s"] for p in published],
            "train_s_per_step": [round(r["train_s"], 2) for r in records],
            "rollout_s_per_step": [round(r["rollout_s"], 2) for r in records],
            "staleness_max": max(r["staleness_max"] for r in records)}


def table(rows: list[dict]) -> str:
    elastic = next((r for r in rows if r["policy"] == "elastic"), None)
    lines = ["| policy | total s | steps s | steps s ÷ elastic's | step s | rollout s | train s | "
             "moves to train (s each) | moves to rollout (s each) | members/step | "
             "micro-batches streamed before the tail/step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['steps_s'] / elastic['steps_s']:.2f}x" if elastic else "-"
        lines.append(f"| {r['policy']} | {r['total_s']} | {r['steps_s']} | {ratio} | "
                     f"{r['step_s']} | {r['rollout_s']} | {r['train_s']} | "
                     f"{r['num_to_training']} ({r['to_training_s']}) | "
                     f"{r['num_to_rollout']} ({r['to_rollout_s']}) | "
                     f"{r['members_per_step']} | " + ", ".join(
                         f"{a}/{b}" for a, b in zip(r["streamed_micro_batches_per_step"],
                                                    r["micro_batches_per_step"], strict=True))
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies",
                        default="split,elastic,elastic-resident,elastic-async,colocate")
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--num-cells", type=int, default=3)
    parser.add_argument("--num-training-cells", type=int, default=1)
    parser.add_argument("--num-session-slots", type=int, default=2)
    parser.add_argument("--groups-per-step", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--num-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--fast-s", type=float, default=0.5)
    parser.add_argument("--slow-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args(argv)
    from undertow.learner.modeldir import init_model_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="live-elastic-") as tmp:
        work = Path(tmp)
        model_dir = init_model_dir(work / "model", size="tiny", seed=0)
        for policy in args.policies.split(","):
            rows.append(run_policy(policy, args, model_dir, work))
            print(json.dumps(rows[-1]), flush=True)
    machine = {"num_cpus": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0]}
    settings = {k: v for k, v in vars(args).items() if k != "policies"}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"settings": settings, "machine": machine, "rows": rows},
                                  indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
