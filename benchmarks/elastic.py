"""Elastic cells versus colocated training and the best fixed split, in the simulator.

    python -m benchmarks.elastic [--cells 16] [--steps 6] [--seed 0]

For each shipped workload (`qwengyre_long_tail`, `short_tail`) it runs, at equal cells, steps
and samples (the same sessions, drawn per step from the seed): `colocate`, `split` with every
number of training cells from 1 to cells - 1 (the best is kept), and `elastic`. Then, on the
long-tail workload only, it repeats the comparison with the training cost scaled (x0.25 to x4)
to show how much of elastic's gain hangs on the ratio of training to rollout time, which the
workload file sets by hand, and once with sessions trained one by one as they end instead of
whole groups (the default, which makes the learner wait for each group's slowest session).
Writes benchmarks/results/elastic.json, the timeline picture
benchmarks/results/elastic_timeline.png, and prints Markdown tables.

Targets from issue 7 (QwenGyre's figures): elastic >= 1.78x over the best split and >= 1.2x over
colocate on the long-tail workload. The simulator is not tuned to meet them; the tables say
whether it does.
"""

import argparse
import dataclasses
import json
from pathlib import Path

from undertow.learner.sim import SimResult, format_table, load_workload, simulate
from undertow.learner.sim.plot import plot_timeline

RESULTS_DIR = Path(__file__).parent / "results"
WORKLOADS = ("qwengyre_long_tail", "short_tail")
TRAINING_COST_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)
TARGET_VS_SPLIT, TARGET_VS_COLOCATE = 1.78, 1.2


def compare(workload, num_cells: int, num_steps: int, seed: int) -> dict[str, SimResult]:
    """colocate, the best split (searched over every ratio) and elastic on one workload."""
    splits = [simulate(workload, {"name": "split", "num_training_cells": n}, num_cells,
                       num_steps, seed) for n in range(1, num_cells)]
    results = {
        "colocate": simulate(workload, "colocate", num_cells, num_steps, seed),
        "best_split": min(splits, key=lambda r: r.makespan_s),
        "elastic": simulate(workload, "elastic", num_cells, num_steps, seed),
    }
    samples = {name: [s.num_sessions for s in r.steps] for name, r in results.items()}
    if len({tuple(v) for v in samples.values()}) != 1:
        raise RuntimeError(f"policies saw different numbers of samples per step: {samples}")
    results["_splits"] = splits
    return results


def ratios(results: dict[str, SimResult]) -> dict[str, float]:
    elastic = results["elastic"].makespan_s
    return {"elastic_vs_best_split": results["best_split"].makespan_s / elastic,
            "elastic_vs_colocate": results["colocate"].makespan_s / elastic}


def scaled_training(workload, scale: float):
    rate = workload.trainer.tokens_per_s_per_cell / scale
    trainer = dataclasses.replace(workload.trainer, tokens_per_s_per_cell=rate)
    return dataclasses.replace(workload, trainer=trainer, name=f"{workload.name} (train x{scale})")


def _ratio_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    lines = ["| workload | elastic vs best split | elastic vs colocate | targets met |",
             "|---|---|---|---|"]
    for name, r in rows:
        met = (r["elastic_vs_best_split"] >= TARGET_VS_SPLIT
               and r["elastic_vs_colocate"] >= TARGET_VS_COLOCATE)
        lines.append(f"| {name} | {r['elastic_vs_best_split']:.2f}x "
                     f"| {r['elastic_vs_colocate']:.2f}x | {'yes' if met else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sweep-steps", type=int, default=3,
                        help="steps per run in the training-cost sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    report = {"num_cells": args.cells, "num_steps": args.steps, "seed": args.seed,
              "targets": {"elastic_vs_best_split": TARGET_VS_SPLIT,
                          "elastic_vs_colocate": TARGET_VS_COLOCATE},
              "workloads": {}, "training_cost_sweep": {}}
    main_rows, sweep_rows, timeline = [], [], None
    for name in WORKLOADS:
        results = compare(load_workload(name), args.cells, args.steps, args.seed)
        r = ratios(results)
        report["workloads"][name] = {
            **r, **{k: results[k].to_dict() for k in ("colocate", "best_split", "elastic")},
            "split_search": {s.policy: s.time_per_step_s for s in results["_splits"]}}
        main_rows.append((name, r))
        print(format_table([results[k] for k in ("colocate", "best_split", "elastic")]), "\n")
        if timeline is None:
            timeline = [results[k] for k in ("colocate", "best_split", "elastic")]
    long_tail = load_workload(WORKLOADS[0])
    variants = [scaled_training(long_tail, scale) for scale in TRAINING_COST_SCALES]
    variants.append(dataclasses.replace(
        long_tail, name=f"{long_tail.name} (sessions stream one by one)",
        trainer=dataclasses.replace(long_tail.trainer, train_unit="session")))
    for variant in variants:
        results = compare(variant, args.cells, args.sweep_steps, args.seed)
        r = ratios(results)
        report["training_cost_sweep"][variant.name] = {
            **r, "best_split": results["best_split"].policy,
            **{f"{k}_time_per_step_s": results[k].time_per_step_s
               for k in ("colocate", "best_split", "elastic")}}
        sweep_rows.append((results["elastic"].workload, r))

    print(_ratio_table(main_rows), "\n")
    print(f"Training-cost sweep on {WORKLOADS[0]} ({args.sweep_steps} steps per run):\n")
    print(_ratio_table(sweep_rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elastic.json").write_text(json.dumps(report, indent=1))
    plot_timeline(timeline, args.out / "elastic_timeline.png")
    print(f"\nwrote {args.out / 'elastic.json'} and {args.out / 'elastic_timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
