"""What a simulation run reports: per-step records, utilisation per role, and the timeline.

Utilisation of a role is busy cell-time over the cell-time spent in that role: a rollout cell is
busy while its engine has at least one sequence generating (not while every session on it waits
for tools); a training cell is busy while it trains tokens or runs the optimizer step (not while
it waits for finished groups or for the weight sync). Time per step is the makespan over the
number of steps, since an asynchronous policy overlaps consecutive steps.

The work floor is what the run's own work needs at least, per step: the slot-seconds its sessions
held (over the slots of a cell) plus the cell-seconds its unique tokens take to train, spread over
every cell. No policy can run those sessions and that training faster, whatever it overlaps; the
optimizer steps, weight syncs and role switches come on top. Slot-seconds depend a little on the
policy (a fuller engine decodes each sequence more slowly), so the floor is per run.
"""

import dataclasses
import statistics
from typing import TYPE_CHECKING

import numpy as np

from undertow.cells import Role
from undertow.cells.policy import Elastic, Split

if TYPE_CHECKING:
    from undertow.cells.policy import Policy
    from undertow.cells.sim.simulator import Simulator


@dataclasses.dataclass(frozen=True)
class RoleSpan:
    """Cell `cell_id` held `role` from `start_s` to `end_s` (end > start)."""

    cell_id: int
    role: Role
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One published step. `staleness` = step - weight version that generated its sessions;
    `tail_share` = share of its rollout time taken by its last 10% of sessions."""

    step: int
    dispatched_s: float
    rollout_done_s: float
    published_s: float
    staleness: int
    num_sessions: int
    num_timed_out: int
    num_unique_tokens: int
    tail_share: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """A whole run. Invariants: `steps` are ordered and complete (one per step); every
    utilisation is in [0, 1]; `cell_s` sums to num_cells x makespan_s."""

    workload: str
    policy: str
    num_cells: int
    seed: int
    makespan_s: float
    steps: tuple[StepRecord, ...]
    cell_s: dict[str, float]
    utilisation: dict[str, float]
    session_p50_s: float
    session_p99_s: float
    num_sessions: int
    num_timed_out: int
    timeline: tuple[RoleSpan, ...]
    work_floor_s: float = 0.0

    @property
    def time_per_step_s(self) -> float:
        return self.makespan_s / len(self.steps)

    @property
    def work_floor_per_step_s(self) -> float:
        return self.work_floor_s / len(self.steps)

    @property
    def mean_staleness(self) -> float:
        return statistics.fmean(step.staleness for step in self.steps)

    @property
    def switching_share(self) -> float:
        return self.cell_s["switching"] / (self.num_cells * self.makespan_s)

    @property
    def mean_tail_share(self) -> float:
        return statistics.fmean(step.tail_share for step in self.steps)

    def to_dict(self, with_timeline: bool = False) -> dict:
        data = {
            "workload": self.workload, "policy": self.policy, "num_cells": self.num_cells,
            "seed": self.seed, "num_steps": len(self.steps), "makespan_s": self.makespan_s,
            "time_per_step_s": self.time_per_step_s,
            "work_floor_per_step_s": self.work_floor_per_step_s, "utilisation": self.utilisation,
            "cell_s": self.cell_s, "switching_share": self.switching_share,
            "mean_staleness": self.mean_staleness, "mean_tail_share": self.mean_tail_share,
            "session_p50_s": self.session_p50_s, "session_p99_s": self.session_p99_s,
            "num_sessions": self.num_sessions, "num_timed_out": self.num_timed_out,
            "steps": [dataclasses.asdict(step) for step in self.steps],
        }
        if with_timeline:
            data["timeline"] = [[s.cell_id, s.role.value, s.start_s, s.end_s]
                                for s in self.timeline]
        return data


def summarise(sim: "Simulator") -> SimResult:
    """Freeze a finished simulation into its result."""
    cell_s = dict.fromkeys((role.value for role in Role), 0.0)
    for span in sim.timeline:
        cell_s[span.role.value] += span.end_s - span.start_s
    busy = {"rollout": sim.rollout_busy_s, "training": sim.learner.busy_cell_s}
    utilisation = {role: (busy[role] / cell_s[role] if cell_s[role] else 0.0)
                   for role in busy}
    total_s = sim.num_cells * sim.now_s
    utilisation["overall"] = (sim.rollout_busy_s + sim.learner.busy_cell_s) / total_s
    durations = np.array([s.duration_s for s in sim.sessions.values() if s.done])
    num_tokens = sum(record.num_unique_tokens for record in sim.records)
    work_cell_s = (durations.sum() / sim.workload.engine.num_session_slots
                   + num_tokens / sim.workload.trainer.tokens_per_s_per_cell)
    return SimResult(
        workload=sim.workload.name, policy=_policy_label(sim.policy), num_cells=sim.num_cells,
        seed=sim.seed, makespan_s=sim.now_s, steps=tuple(sorted(sim.records, key=lambda r: r.step)),
        cell_s=cell_s, utilisation=utilisation,
        session_p50_s=float(np.percentile(durations, 50)),
        session_p99_s=float(np.percentile(durations, 99)),
        num_sessions=len(durations), num_timed_out=sum(s.timed_out for s in sim.sessions.values()),
        timeline=tuple(sim.timeline), work_floor_s=float(work_cell_s) / sim.num_cells)


def _policy_label(policy: "Policy") -> str:
    if isinstance(policy, Split):
        return f"split({policy.num_training_cells} training)"
    if isinstance(policy, Elastic) and policy.max_staleness:
        return f"elastic(staleness {policy.max_staleness})"
    return policy.name


TABLE_HEADER = ("| workload | policy | cells | steps | time/step (s) | makespan (h) | rollout util "
                "| training util | switching | staleness | p50 / p99 session (s) | timed out |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(result: SimResult) -> str:
    u = result.utilisation
    return (f"| {result.workload} | {result.policy} | {result.num_cells} | {len(result.steps)} "
            f"| {result.time_per_step_s:.0f} | {result.makespan_s / 3600:.2f} "
            f"| {u['rollout']:.2f} | {u['training']:.2f} | {result.switching_share:.3f} "
            f"| {result.mean_staleness:.2f} | {result.session_p50_s:.0f} / "
            f"{result.session_p99_s:.0f} | {result.num_timed_out}/{result.num_sessions} |")


def format_table(results: list[SimResult]) -> str:
    return "\n".join([TABLE_HEADER, *(table_row(r) for r in results)])
