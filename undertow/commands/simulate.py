"""`undertow simulate`: a cell-pool policy on a workload, as discrete events.

The simulator is `undertow/cells/sim/` (docs/cluster.md): no engine, learner or sandbox
runs; it prints the policy's table and, with `--plot`, draws the cells' roles over time.
"""

import argparse
from pathlib import Path
from typing import Any

from undertow.commands import Commands


def add(commands: Commands) -> None:
    simulate = commands.add_parser(
        "simulate", help="simulate a cell-pool policy on a workload (discrete events)")
    simulate.add_argument("--workload", required=True, help="workload YAML/JSON file, or a "
                          "preset: qwengyre_long_tail, short_tail")
    simulate.add_argument("--policy", required=True, help="colocate, split or elastic")
    simulate.add_argument("--cells", type=int, required=True, help="number of cells")
    simulate.add_argument("--steps", type=int, default=4, help="RL steps to simulate")
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--training-cells", type=int, default=None,
                          help="split only: cells that train (default: half)")
    simulate.add_argument("--max-staleness", type=int, default=None,
                          help="split and elastic: how many steps the rollout weights may "
                          "lag (0: synchronous; default: the policy's, as in `undertow "
                          "train`: 1 for split, 0 for elastic)")
    simulate.add_argument("--plot", type=Path, default=None, help="write the roles timeline PNG")
    simulate.set_defaults(handler=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    from undertow.cells.sim import format_table, load_workload, simulate
    from undertow.cells.sim.plot import plot_timeline

    spec: dict[str, Any] = {"name": args.policy}
    if args.policy == "split":
        spec["num_training_cells"] = args.training_cells or max(1, args.cells // 2)
    if args.policy in ("split", "elastic") and args.max_staleness is not None:
        spec["max_staleness"] = args.max_staleness
    result = simulate(load_workload(args.workload), spec, num_cells=args.cells,
                      num_steps=args.steps, seed=args.seed)
    print(format_table([result]))
    if args.plot is not None:
        print(plot_timeline([result], args.plot))
    return 0
