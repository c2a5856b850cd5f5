"""A discrete-event simulator of the elastic cell pool, driven by the pool's own policies.

`workload` describes the sessions (long-tailed turns, tokens and tool latencies, a time limit)
and the cluster; `timing` the engine and learner cost models; `rollout` and `training` the two
sides; `simulator` the event loop; `results` and `plot` what a run reports. Entry point:

    result = simulate(load_workload("qwengyre_long_tail"),
                      {"name": "elastic", "max_staleness": 1}, num_cells=16, num_steps=8)

(`"elastic"` alone is the synchronous form, staleness 0; see `undertow.cells.policy`.)

Errors: bad workloads raise ValueError, a missing file FileNotFoundError, a policy that stalls or
breaks the pool's rules SimulationError (or the pool's IllegalTransition).
"""

from typing import Any

from undertow.cells import Policy, make_policy
from undertow.cells.sim.results import SimResult, format_table
from undertow.cells.sim.simulator import SimulationError, Simulator
from undertow.cells.sim.workload import Workload, load_workload, workload_from_dict


def simulate(workload: Workload, policy: str | dict[str, Any] | Policy, num_cells: int,
             num_steps: int, seed: int = 0) -> SimResult:
    """Run one simulation; `policy` is a name, a plain dict spec, or a policy object."""
    if isinstance(policy, str | dict):
        policy = make_policy(policy)
    return Simulator(workload, policy, num_cells, num_steps, seed).run()


__all__ = ["SimResult", "SimulationError", "Simulator", "Workload", "format_table",
           "load_workload", "simulate", "workload_from_dict"]
