"""Which finished groups a step trains: the group filter of the run's loop.

The run's loop (`undertow/cells/loop.py`) takes finished groups from its rollout source and
passes each through one `GroupFilter`. Only real outcomes
train (`advantages.valid_sessions`): a group left with fewer than two valid sessions
(one when `group_size` is 1), or with fewer than two once `advantages.timeout_reward="drop"`
leaves out the cut ones, is dropped, with its reason written to the run's log
(`run_log.py`, `RUN/train.log`; the step's one printed line counts it); with
`advantages.filter_uniform_groups`, so is a group whose sessions all enter its advantages
with the same reward (`advantages.session_rewards`: a cut session by `timeout_reward`),
at most `advantages.max_extra_groups` per step. The caller replaces what is dropped.
When `max_failed_groups` groups in a row lost every session to failures of Undertow
itself, `admit` raises one `RunFailedError` naming the causes and the last error; when
that many in a row were left with too few sessions by the time limit, one saying so.

What a step dropped and re-ran is kept in its `StepCounts`, which become the step's
metrics fields (`metrics_log.py`: `num_dropped_uniform`, `num_dropped_invalid`,
`infra_failures` by cause, `num_rerun_sessions`, ...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from undertow.learner.advantages import (
    infra_failures,
    is_uniform,
    session_rewards,
    valid_sessions,
)
from undertow.learner.config import AdvantageConfig
from undertow.learner.errors import RunFailedError
from undertow.learner.run_log import RunLog

DROP_REASONS = ("stale", "uniform", "invalid", "empty")


@dataclass
class StepCounts:
    """What one step dropped (groups, by reason in `DROP_REASONS`) and what Undertow
    failed and re-ran (sessions) while its groups came in."""

    dropped: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    num_reruns: int = 0

    def metrics(self) -> dict[str, Any]:
        """The step's metrics fields of these counts."""
        return {"num_dropped_groups": self.dropped["stale"],
                "num_dropped_uniform": self.dropped["uniform"],
                "num_dropped_invalid": self.dropped["invalid"] + self.dropped["empty"],
                "num_rerun_sessions": self.num_reruns,
                "num_infra_failures": sum(self.failures.values()),
                "infra_failures": dict(self.failures)}


def note_drop(counts: StepCounts, log: RunLog, step: int, reason: str, message: str) -> None:
    """Counts a dropped group in `counts` (the step's printed line and metrics say how
    many) and writes why to the run's log (one line, for step `step`)."""
    counts.dropped[reason] += 1
    log.write(step, f"dropped {message}")


class GroupFilter:
    """The group filter of one run (see the module docstring).

    Invariant: `failed_in_a_row` holds the groups dropped since the last group that had
    a valid session (or that lost none to Undertow), oldest first; `cut_in_a_row`, the
    (sessions, cut sessions) of the groups dropped since the last one with two sessions
    to train; neither's length reaches `max_failed_groups` (`admit` raises first)."""

    def __init__(self, group_size: int, max_failed_groups: int, advantages: AdvantageConfig,
                 log: RunLog):
        self.group_size, self.max_failed_groups = group_size, max_failed_groups
        self.advantages, self.log = advantages, log
        self.failed_in_a_row: list[Any] = []
        self.cut_in_a_row: list[tuple[int, int]] = []

    def admit(self, group: Any, counts: StepCounts, step: int) -> str | None:
        """None when the finished group (`train.FinishedGroup`) may train in step `step`;
        else the reason it is dropped (counted in `counts`, logged). Its failed and
        re-run sessions are counted either way."""
        failures = group.failures or infra_failures(group.tree)
        counts.failures.update(failures)
        counts.num_reruns += (group.num_reruns if group.num_reruns is not None else
                              sum(bool(p.meta.get("attempt")) for p in
                                  group.tree.sessions.values()))
        rewards = valid_sessions(group.tree)
        if len(rewards) < min(2, self.group_size):
            note_drop(counts, self.log, step, "invalid",
                      f"group {group.tree.group_id}: {len(rewards)} valid session(s) left; "
                      f"Undertow failed {dict(failures) or 'none'}"
                      f"{': ' + group.error if group.error else ''}")
            self._count_failed(group, failures, rewards)
            return "invalid"
        self.failed_in_a_row.clear()
        entered = session_rewards(group.tree, self.advantages)   # what advantages see
        if len(entered) < min(2, self.group_size):
            note_drop(counts, self.log, step, "invalid",
                      f"group {group.tree.group_id}: {len(rewards) - len(entered)} of its "
                      f"{len(rewards)} valid sessions were cut by their time limit, which "
                      f"advantages.timeout_reward=drop leaves out; {len(entered)} left")
            self._count_cut(len(rewards), len(rewards) - len(entered))
            return "invalid"
        self.cut_in_a_row.clear()
        if not self.advantages.filter_uniform_groups:
            return None
        if is_uniform(entered) and counts.dropped["uniform"] < self.advantages.max_extra_groups:
            note_drop(counts, self.log, step, "uniform",
                      f"group {group.tree.group_id}: every session trained would enter with "
                      f"reward {next(iter(entered.values()), None)} (no signal)")
            return "uniform"
        return None

    def _count_cut(self, num_sessions: int, num_cut: int) -> None:
        """Raises RunFailedError once `max_failed_groups` groups in a row were left with
        too few sessions to train by the time limit: with `drop`, a limit that cuts most
        sessions would have the run launch groups for ever and train none."""
        self.cut_in_a_row.append((num_sessions, num_cut))
        if len(self.cut_in_a_row) < self.max_failed_groups:
            return
        num_sessions = sum(n for n, _ in self.cut_in_a_row)
        num_cut = sum(c for _, c in self.cut_in_a_row)
        raise RunFailedError(
            f"the last {len(self.cut_in_a_row)} groups had too few sessions to train: their "
            f"time limit cut {num_cut} of their {num_sessions} sessions, and "
            f"advantages.timeout_reward=drop leaves cut sessions out. Raise rollout.timeout_s, "
            f"or enter cut sessions by advantages.timeout_reward=tree_value or "
            f"partial_credit, and resume.")

    def _count_failed(self, group: Any, failures: dict[str, int],
                      rewards: dict[str, float]) -> None:
        """Raises RunFailedError once `max_failed_groups` groups in a row lost their
        sessions to failures of Undertow's own."""
        if rewards or not failures:
            self.failed_in_a_row.clear()
            return
        self.failed_in_a_row.append(group)
        if len(self.failed_in_a_row) < self.max_failed_groups:
            return
        causes: Counter = Counter()
        for failed in self.failed_in_a_row:
            causes.update(failed.failures or infra_failures(failed.tree))
        named = (f"every session failed with {next(iter(causes))}" if len(causes) == 1
                 else f"their sessions failed with {dict(causes)}")
        last_error = next((g.error for g in reversed(self.failed_in_a_row) if g.error), "")
        raise RunFailedError(
            f"the last {len(self.failed_in_a_row)} groups had no session the policy could "
            f"be trained on: {named} (a failure of Undertow, not of the policy, after each "
            f"slot's configured attempts)" + (f"; last error: {last_error}" if last_error
                                              else "") + ". Fix that cause and rerun.")
