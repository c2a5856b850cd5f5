"""What a rollout reports: one record per session (`SessionResult`), the run summary
(`RolloutSummary`) and live progress (`Progress`). Which causes are outcomes, and which are
failures of Undertow's own: docs/adapters.md#what-a-rollout-reports.
"""

import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

# Causes that are not failures of the scaffold: it ended by itself or ran out of time.
NOT_FAILURES = ("exited", "timeout")
# Causes of sessions whose reward the policy earned (docs/adapters.md#what-a-rollout-reports).
OUTCOME_CAUSES = ("exited", "crashed", "timeout", "output_flood")
# Causes of sessions that never ended: a rollout stopped part-way (interrupted, killed)
# writes its summary with them; a resumed evaluation runs them again.
UNFINISHED_CAUSES = ("pending", "interrupted")


def ended_sessions(sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sessions of a summary.json that ended, without those a stopped run never ran
    or stopped (`UNFINISHED_CAUSES`)."""
    return [s for s in sessions if s["cause"] not in UNFINISHED_CAUSES]


def is_infra_failure(cause: str) -> bool:
    """Whether a session that ended with `cause` failed through Undertow, not the policy."""
    return cause not in OUTCOME_CAUSES


def gateway_errors(session: dict[str, Any]) -> str:
    """The failures of Undertow's own the gateway noted on a session (`infra_errors` of
    its summary, `GET /admin/sessions/{id}`), in words; empty when there were none."""
    errors = session.get("infra_errors") or {}
    return ", ".join(f"{reason} x{num}" for reason, num in errors.items())


@dataclass
class SessionResult:
    """One session of a rollout.

    `cause` is how it ended: the scaffold's exit cause (`exited`, `crashed`, `timeout`,
    `output_flood`, `killed`), `interrupted` (Ctrl-C), or `error:<stage>` when Undertow
    could not run or grade it (then `error` says why; `scaffold_cause` is the scaffold's
    own where the gateway's errors ended it: `error:gateway`). `reward_source` is `grade`,
    `partial_credit`, `tree_estimate` or `none` (not graded: reward 0).
    """

    instance_id: str
    index: int
    session_id: str = ""
    attempt: int = 0
    cause: str = "pending"
    exit_code: int | None = None
    reward: float = 0.0
    reward_source: str = "none"
    resolved: bool = False
    grade_reason: str = ""
    tests: dict[str, str] = field(default_factory=dict)
    partial_credit: float | None = None
    tree_value: dict[str, Any] | None = None
    error: str = ""
    duration_s: float = 0.0
    num_calls: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_output_bytes: int = 0
    log_tail: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    closed: bool = False
    scaffold_cause: str = ""

    @property
    def timed_out(self) -> bool:
        return self.cause == "timeout"

    @property
    def infra_failure(self) -> bool:
        return is_infra_failure(self.cause)

    def take_verdict(self, meta: dict[str, Any]) -> None:
        """Takes the gateway's verdict from the meta it closed the session with: a
        session it failed (`infra_failure`) is an infra failure here too, with the
        gateway's cause and reasons, so that its slot runs again."""
        if meta.get("infra_failure") and not self.infra_failure:
            self.scaffold_cause = self.cause
            self.cause = str(meta.get("cause") or "error:gateway")
            self.error = str(meta.get("error") or "")

    def meta(self) -> dict[str, Any]:
        """What goes to the gateway with the reward (the log tail shortened)."""
        record = asdict(self)
        record.pop("closed")
        record["log_tail"] = self.log_tail[-1000:]
        record["infra_failure"] = self.infra_failure
        return record


@dataclass
class TaskSummary:
    instance_id: str
    num_sessions: int
    pass_rate: float
    rewards: list[float]
    mean_reward: float
    num_completion_tokens: int
    mean_duration_s: float
    num_timeouts: int
    failures: dict[str, int]


@dataclass
class RolloutSummary:
    """The whole run: per-task summaries, every session, and totals."""

    run_id: str
    scaffold: str
    duration_s: float
    sessions: list[SessionResult]
    interrupted: bool = False

    def tasks(self) -> list[TaskSummary]:
        by_task: dict[str, list[SessionResult]] = {}
        for result in self.sessions:
            by_task.setdefault(result.instance_id, []).append(result)
        return [_task_summary(instance_id, results) for instance_id, results in by_task.items()]

    @property
    def outcomes(self) -> list[SessionResult]:
        """The sessions whose reward the policy earned (no failure of Undertow's own)."""
        return [r for r in self.sessions if not r.infra_failure]

    @property
    def pass_rate(self) -> float:
        outcomes = self.outcomes
        return sum(r.resolved for r in outcomes) / len(outcomes) if outcomes else 0

    def failures(self) -> dict[str, int]:
        return dict(Counter(r.cause for r in self.sessions if r.cause not in NOT_FAILURES))

    def infra_failures(self) -> dict[str, int]:
        """Sessions that failed through Undertow, by cause."""
        return dict(Counter(r.cause for r in self.sessions if r.infra_failure))

    @property
    def num_reruns(self) -> int:
        """Sessions run again after an earlier attempt of their slot failed."""
        return sum(r.attempt > 0 for r in self.sessions)

    def to_json(self) -> dict[str, Any]:
        num_tokens = sum(r.num_completion_tokens for r in self.sessions)
        return {"run_id": self.run_id, "scaffold": self.scaffold,
                "duration_s": self.duration_s, "interrupted": self.interrupted,
                "num_sessions": len(self.sessions), "pass_rate": self.pass_rate,
                "mean_reward": _mean([r.reward for r in self.outcomes]),
                "num_timeouts": sum(r.timed_out for r in self.sessions),
                "failures": self.failures(), "infra_failures": self.infra_failures(),
                "num_reruns": self.num_reruns, "num_completion_tokens": num_tokens,
                "sessions_per_minute": 60 * len(self.sessions) / max(self.duration_s, 1e-9),
                "tasks": [asdict(task) for task in self.tasks()],
                "sessions": [asdict(result) for result in self.sessions]}

    def table(self) -> str:
        lines = ["| task | sessions | pass rate | rewards | tokens | mean duration (s) | "
                 "timeouts | failures |", "|---|---|---|---|---|---|---|---|"]
        for task in self.tasks():
            rewards = " ".join(f"{reward:.2f}" for reward in task.rewards)
            failures = ", ".join(f"{cause} {n}" for cause, n in sorted(task.failures.items()))
            lines.append(f"| {task.instance_id} | {task.num_sessions} | {task.pass_rate:.0%} | "
                         f"{rewards} | {task.num_completion_tokens} | "
                         f"{task.mean_duration_s:.1f} | {task.num_timeouts} | "
                         f"{failures or '-'} |")
        total = self.to_json()
        lines.append(f"| **all** | {total['num_sessions']} | {total['pass_rate']:.0%} | "
                     f"mean {total['mean_reward']:.2f} | {total['num_completion_tokens']} | "
                     f"{self.duration_s:.1f} (run) | {total['num_timeouts']} | "
                     f"{', '.join(f'{c} {n}' for c, n in sorted(total['failures'].items())) or '-'}"
                     " |")
        return "\n".join(lines)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _task_summary(instance_id: str, results: list[SessionResult]) -> TaskSummary:
    outcomes = [r for r in results if not r.infra_failure]
    return TaskSummary(
        instance_id=instance_id, num_sessions=len(results),
        pass_rate=sum(r.resolved for r in outcomes) / len(outcomes) if outcomes else 0.0,
        rewards=[r.reward for r in outcomes], mean_reward=_mean([r.reward for r in outcomes]),
        num_completion_tokens=sum(r.num_completion_tokens for r in results),
        mean_duration_s=_mean([r.duration_s for r in results]),
        num_timeouts=sum(r.timed_out for r in results),
        failures=dict(Counter(r.cause for r in results if r.cause not in NOT_FAILURES)))


class Progress:
    """Counters of a running rollout, printed as one line every `interval_s`."""

    def __init__(self, num_tasks: int, num_sessions: int, stream: TextIO | None = None,
                 interval_s: float = 5.0):
        self.num_tasks, self.num_sessions = num_tasks, num_sessions
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.started_s = time.monotonic()
        self.num_tasks_done = 0
        self.num_running = 0
        self.ended: list[SessionResult] = []

    def line(self) -> str:
        elapsed_s = max(time.monotonic() - self.started_s, 1e-9)
        outcomes = [r for r in self.ended if not r.infra_failure]
        num_resolved = sum(r.resolved for r in outcomes)
        num_tokens = sum(r.num_completion_tokens for r in self.ended)
        rate = f"{num_resolved / len(outcomes):.0%}" if outcomes else "-"
        failed = Counter(r.cause for r in self.ended if r.infra_failure)
        reruns = (" · re-run after " + ", ".join(f"{c} {n}" for c, n in sorted(failed.items()))
                  if failed else "")
        return (f"[rollout {elapsed_s:6.0f}s] tasks {self.num_tasks_done}/{self.num_tasks} · "
                f"sessions {len(outcomes)}/{self.num_sessions} done, {self.num_running} "
                f"running · pass {rate} ({num_resolved}/{len(outcomes)}){reruns} · "
                f"{num_tokens / elapsed_s:.1f} tok/s")

    def print(self) -> None:
        if self.interval_s > 0:
            print(self.line(), file=self.stream, flush=True)
