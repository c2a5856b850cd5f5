"""What a rollout reports: one record per session, the run summary, and live progress.

`SessionResult` is what the runner learns about one session and attaches (as `meta`)
when it closes the session at the gateway. `RolloutSummary` aggregates them per task
(pass rate, rewards, tokens, durations, timeouts, failures by cause) and renders JSON
and a Markdown table. `Progress` prints one line at a time while the run goes on:
tasks done, sessions running, pass rate so far, tokens per second.
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


@dataclass
class SessionResult:
    """One session of a rollout.

    `cause` is how it ended: the scaffold's exit cause (`exited`, `crashed`, `timeout`,
    `output_flood`, `killed`), `interrupted` (Ctrl-C), or `error:<stage>` when Undertow
    could not run or grade it (then `error` says why). `reward_source` is `grade`,
    `partial_credit`, `tree_estimate` or `none` (not graded: reward 0).
    """

    instance_id: str
    index: int
    session_id: str = ""
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

    @property
    def timed_out(self) -> bool:
        return self.cause == "timeout"

    def meta(self) -> dict[str, Any]:
        """What goes to the gateway with the reward (the log tail shortened)."""
        record = asdict(self)
        record.pop("closed")
        record["log_tail"] = self.log_tail[-1000:]
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
    def pass_rate(self) -> float:
        return sum(r.resolved for r in self.sessions) / len(self.sessions) if self.sessions else 0

    def failures(self) -> dict[str, int]:
        return dict(Counter(r.cause for r in self.sessions if r.cause not in NOT_FAILURES))

    def to_json(self) -> dict[str, Any]:
        num_tokens = sum(r.num_completion_tokens for r in self.sessions)
        return {"run_id": self.run_id, "scaffold": self.scaffold,
                "duration_s": self.duration_s, "interrupted": self.interrupted,
                "num_sessions": len(self.sessions), "pass_rate": self.pass_rate,
                "mean_reward": _mean([r.reward for r in self.sessions]),
                "num_timeouts": sum(r.timed_out for r in self.sessions),
                "failures": self.failures(), "num_completion_tokens": num_tokens,
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
    return TaskSummary(
        instance_id=instance_id, num_sessions=len(results),
        pass_rate=sum(r.resolved for r in results) / len(results),
        rewards=[r.reward for r in results], mean_reward=_mean([r.reward for r in results]),
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
        num_resolved = sum(r.resolved for r in self.ended)
        num_tokens = sum(r.num_completion_tokens for r in self.ended)
        rate = f"{num_resolved / len(self.ended):.0%}" if self.ended else "-"
        return (f"[rollout {elapsed_s:6.0f}s] tasks {self.num_tasks_done}/{self.num_tasks} · "
                f"sessions {len(self.ended)}/{self.num_sessions} done, {self.num_running} "
                f"running · pass {rate} ({num_resolved}/{len(self.ended)}) · "
                f"{num_tokens / elapsed_s:.1f} tok/s")

    def print(self) -> None:
        if self.interval_s > 0:
            print(self.line(), file=self.stream, flush=True)
