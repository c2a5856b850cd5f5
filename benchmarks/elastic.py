"""Elastic cells versus colocated training and the best fixed split, in the simulator.

    python -m benchmarks.elastic [--cells 16] [--steps 48] [--seed 0]

For each shipped workload (`qwengyre_long_tail`, `short_tail`) it runs, at equal cells, steps
and samples (the same sessions, drawn per step from the seed):

- `colocate` (synchronous by construction: staleness 0);
- `split` with every number of training cells from 1 to cells - 1, asynchronous with
  `max_staleness` (default 1: the next step's sessions start while the tail of the current one
  runs and the learner trains); the fastest is the best split;
- `elastic` with the same `max_staleness` (the main comparison), and `elastic` synchronous
  (staleness 0), which is the on-policy comparison with colocate.

Each run also reports its work floor (see `undertow/cells/sim/results.py`): slot-seconds of
rollout plus cell-seconds of training per step over the cells, below which no policy can
go. It shows how much room the best split leaves, hence the most any policy could gain over it.

Then, on the long-tail workload only, it repeats the comparison with the training cost scaled
(x0.25 to x4), since the workload file sets the ratio of training to rollout time by hand, and
once with sessions trained one by one as they end instead of whole groups. In that sweep the
split is searched by walking from the main comparison's best ratio while the time improves (the
time per step is unimodal in the ratio: training-bound below, rollout-bound above).
Writes benchmarks/results/elastic.json, the timeline picture
benchmarks/results/elastic_timeline.png, and prints Markdown tables.

Targets from issue 7 (QwenGyre's figures: 48 steps, 1.78x over a tuned asynchronous split, up to
1.85x over colocated training): elastic >= 1.78x over the best split and >= 1.2x over colocate on
the long-tail workload. The simulator is not tuned to meet them; the tables say whether it does.
"""

import argparse
import dataclasses
import json
from pathlib import Path

from undertow.cells.sim import SimResult, format_table, load_workload, simulate
from undertow.cells.sim.plot import plot_timeline

RESULTS_DIR = Path(__file__).parent / "results"
WORKLOADS = ("qwengyre_long_tail", "short_tail")
TRAINING_COST_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
TARGET_VS_SPLIT, TARGET_VS_COLOCATE = 1.78, 1.2
MAIN = ("colocate", "best_split", "elastic", "elastic_sync")
TIMELINE_HOURS = 12.0


class Runs:
    """Runs of one workload at fixed cells, steps, seed and staleness; splits are cached."""

    def __init__(self, workload, num_cells: int, num_steps: int, seed: int, max_staleness: int):
        self.workload, self.num_cells, self.num_steps = workload, num_cells, num_steps
        self.seed, self.max_staleness = seed, max_staleness
        self.splits: dict[int, SimResult] = {}

    def run(self, spec) -> SimResult:
        return simulate(self.workload, spec, self.num_cells, self.num_steps, self.seed)

    def split(self, num_training_cells: int) -> SimResult:
        if num_training_cells not in self.splits:
            self.splits[num_training_cells] = self.run(
                {"name": "split", "num_training_cells": num_training_cells,
                 "max_staleness": self.max_staleness})
        return self.splits[num_training_cells]

    def best_split_everywhere(self) -> SimResult:
        return min((self.split(n) for n in range(1, self.num_cells)), key=_makespan)

    def best_split_from(self, start: int) -> SimResult:
        """Walk from `start` towards the faster neighbour until neither neighbour is faster."""
        best = start
        while True:
            neighbours = [n for n in (best - 1, best + 1) if 1 <= n < self.num_cells]
            fastest = min(neighbours, key=lambda n: self.split(n).makespan_s)
            if self.split(fastest).makespan_s >= self.split(best).makespan_s:
                return self.split(best)
            best = fastest

    def compare(self, best_split: SimResult) -> dict[str, SimResult]:
        results = {
            "colocate": self.run("colocate"),
            "best_split": best_split,
            "elastic": self.run({"name": "elastic", "max_staleness": self.max_staleness}),
            "elastic_sync": self.run({"name": "elastic", "max_staleness": 0}),
        }
        samples = {name: [s.num_sessions for s in r.steps] for name, r in results.items()}
        if len({tuple(v) for v in samples.values()}) != 1:
            raise RuntimeError(f"policies saw different numbers of samples per step: {samples}")
        return results


def _makespan(result: SimResult) -> float:
    return result.makespan_s


def ratios(results: dict[str, SimResult]) -> dict[str, float]:
    elastic = results["elastic"].makespan_s
    split = results["best_split"]
    return {"elastic_vs_best_split": split.makespan_s / elastic,
            "elastic_vs_colocate": results["colocate"].makespan_s / elastic,
            "elastic_sync_vs_colocate": (results["colocate"].makespan_s
                                         / results["elastic_sync"].makespan_s),
            "most_any_policy_could_gain_over_best_split": (
                split.time_per_step_s / min(r.work_floor_per_step_s for r in results.values()))}


def scaled_training(workload, scale: float):
    rate = workload.trainer.tokens_per_s_per_cell / scale
    trainer = dataclasses.replace(workload.trainer, tokens_per_s_per_cell=rate)
    return dataclasses.replace(workload, trainer=trainer, name=f"{workload.name} (train x{scale})")


def _summary_table(rows: list[tuple[str, dict[str, SimResult], dict[str, float]]]) -> str:
    lines = ["| workload | colocate | best fixed split | elastic | elastic vs best split "
             "| elastic vs colocate | work floor | most any policy could gain over the split "
             "| elastic, synchronous | synchronous elastic vs colocate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, results, r in rows:
        split = results["best_split"]
        floor = min(result.work_floor_per_step_s for result in results.values())
        lines.append(
            f"| {name} | {results['colocate'].time_per_step_s:.0f} s/step "
            f"| {split.time_per_step_s:.0f} s/step ({split.policy}) "
            f"| {results['elastic'].time_per_step_s:.0f} s/step "
            f"| {r['elastic_vs_best_split']:.2f}x | {r['elastic_vs_colocate']:.2f}x "
            f"| {floor:.0f} s/step | {r['most_any_policy_could_gain_over_best_split']:.2f}x "
            f"| {results['elastic_sync'].time_per_step_s:.0f} s/step "
            f"| {r['elastic_sync_vs_colocate']:.2f}x |")
    return "\n".join(lines)


def _ratio_table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = ["| workload | best split | elastic vs best split | elastic vs colocate "
             "| most any policy could gain over the split | targets met |",
             "|---|---|---|---|---|---|"]
    for name, split, r in rows:
        met = (r["elastic_vs_best_split"] >= TARGET_VS_SPLIT
               and r["elastic_vs_colocate"] >= TARGET_VS_COLOCATE)
        lines.append(f"| {name} | {split} | {r['elastic_vs_best_split']:.2f}x "
                     f"| {r['elastic_vs_colocate']:.2f}x "
                     f"| {r['most_any_policy_could_gain_over_best_split']:.2f}x "
                     f"| {'yes' if met else 'no'} |")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48, help="QwenGyre's flagship run: 48")
    parser.add_argument("--sweep-steps", type=int, default=12,
                        help="steps per run in the training-cost sweep")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="of the split and of the main elastic run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    report = {"num_cells": args.cells, "num_steps": args.steps, "seed": args.seed,
              "max_staleness": args.max_staleness,
              "targets": {"elastic_vs_best_split": TARGET_VS_SPLIT,
                          "elastic_vs_colocate": TARGET_VS_COLOCATE},
              "workloads": {}, "training_cost_sweep": {}}
    main_rows, sweep_rows, timeline, best_long_tail = [], [], None, None
    for name in WORKLOADS:
        runs = Runs(load_workload(name), args.cells, args.steps, args.seed, args.max_staleness)
        results = runs.compare(runs.best_split_everywhere())
        r = ratios(results)
        report["workloads"][name] = {
            **r, **{k: results[k].to_dict() for k in MAIN},
            "split_search": {s.policy: s.time_per_step_s for _, s in sorted(runs.splits.items())}}
        main_rows.append((name, results, r))
        print(format_table([results[k] for k in MAIN]), "\n", flush=True)
        if timeline is None:
            timeline = [results[k] for k in MAIN]
            best_long_tail = results["best_split"]
    long_tail = load_workload(WORKLOADS[0])
    variants = [scaled_training(long_tail, scale) for scale in TRAINING_COST_SCALES]
    variants.append(dataclasses.replace(
        long_tail, name=f"{long_tail.name} (sessions stream one by one)",
        trainer=dataclasses.replace(long_tail.trainer, train_unit="session")))
    start = int(best_long_tail.policy.split("(")[1].split()[0])
    for variant in variants:
        runs = Runs(variant, args.cells, args.sweep_steps, args.seed, args.max_staleness)
        results = runs.compare(runs.best_split_from(start))
        r = ratios(results)
        report["training_cost_sweep"][variant.name] = {
            **r, "best_split": results["best_split"].policy,
            "splits_tried": {s.policy: s.time_per_step_s for _, s in sorted(runs.splits.items())},
            **{f"{k}_time_per_step_s": results[k].time_per_step_s for k in MAIN}}
        sweep_rows.append((variant.name, results["best_split"].policy, r))
        print(f"swept {variant.name}", flush=True)

    print(_summary_table(main_rows), "\n")
    print(f"Training-cost sweep on {WORKLOADS[0]} ({args.sweep_steps} steps per run):\n")
    print(_ratio_table(sweep_rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(report, indent=1))
    plot_timeline(timeline, args.out / "elastic_timeline.png", max_hours=TIMELINE_HOURS)
    print(f"\nwrote {args.out / 'elastic.json'} and {args.out / 'elastic_timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
