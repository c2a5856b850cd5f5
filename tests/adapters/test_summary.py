"""The run summary: per-task aggregates, failures by cause, JSON and table."""

import io
import json

from undertow.adapters.summary import Progress, RolloutSummary, SessionResult


def results() -> list[SessionResult]:
    return [
        SessionResult("t1", 0, "s1", cause="exited", reward=1.0, resolved=True,
                      num_completion_tokens=10, duration_s=2.0),
        SessionResult("t1", 1, "s2", cause="timeout", reward=0.5, num_completion_tokens=30,
                      duration_s=4.0),
        SessionResult("t2", 0, "s3", cause="crashed", num_completion_tokens=5, duration_s=1.0),
        SessionResult("t2", 1, "s4", cause="error:sandbox", error="SandboxError: boom"),
    ]


def test_per_task_pass_rate_rewards_and_failures():
    summary = RolloutSummary("run", "command", 60.0, results())
    first, second = summary.tasks()
    assert (first.pass_rate, first.rewards, first.num_timeouts) == (0.5, [1.0, 0.5], 1)
    assert first.num_completion_tokens == 40 and first.mean_duration_s == 3.0
    assert first.failures == {}
    assert second.failures == {"crashed": 1, "error:sandbox": 1}
    assert summary.failures() == {"crashed": 1, "error:sandbox": 1}
    # The sandbox failure was Undertow's: it is no outcome of the policy.
    assert summary.infra_failures() == {"error:sandbox": 1}
    assert second.rewards == [0.0] and summary.pass_rate == 1 / 3


def test_json_and_table_hold_every_session():
    summary = RolloutSummary("run", "command", 30.0, results())
    data = json.loads(summary.dumps())
    assert data["num_sessions"] == 4 and data["num_timeouts"] == 1
    assert data["sessions_per_minute"] == 8.0
    assert [s["session_id"] for s in data["sessions"]] == ["s1", "s2", "s3", "s4"]
    table = summary.table()
    assert "| t1 | 2 | 50% | 1.00 0.50 | 40 |" in table
    assert "crashed 1, error:sandbox 1" in table


def test_session_meta_is_json_and_bounded():
    result = SessionResult("t1", 0, "s1", log_tail="x" * 5000)
    meta = result.meta()
    assert "closed" not in meta and len(meta["log_tail"]) == 1000
    json.dumps(meta)


def test_meta_and_summary_mark_failures_of_undertow_and_reruns():
    failed = SessionResult("t1", 0, "s1", cause="error:grade", error="GradingError: boom")
    rerun = SessionResult("t1", 0, "s2", attempt=1, cause="exited", reward=1.0, resolved=True)
    assert failed.meta()["infra_failure"] and not rerun.meta()["infra_failure"]
    summary = RolloutSummary("run", "command", 1.0, [failed, rerun])
    data = summary.to_json()
    assert data["infra_failures"] == {"error:grade": 1} and data["num_reruns"] == 1
    assert data["pass_rate"] == 1.0 and data["mean_reward"] == 1.0


def test_progress_line_counts_sessions_and_pass_rate():
    stream = io.StringIO()
    progress = Progress(num_tasks=2, num_sessions=4, stream=stream, interval_s=1)
    progress.ended.extend(results()[:2])
    progress.num_running, progress.num_tasks_done = 1, 1
    progress.print()
    line = stream.getvalue()
    assert "tasks 1/2" in line and "sessions 2/4 done, 1 running" in line
    assert "pass 50% (1/2)" in line and "tok/s" in line


def test_a_session_the_gateway_closed_as_its_failure_is_one_here_too():
    """The gateway's close meta (`Session.close_meta`) overrides an outcome the runner
    saw: a scaffold that crashed on the gateway's error replies is Undertow's failure."""
    crashed = SessionResult("t", 0, "s1", cause="crashed")
    crashed.take_verdict({"cause": "error:gateway", "infra_failure": True,
                          "scaffold_cause": "crashed",
                          "error": "Undertow failed this session: 503 Unavailable x1"})
    assert (crashed.cause, crashed.scaffold_cause, crashed.infra_failure) == (
        "error:gateway", "crashed", True)
    assert "503 Unavailable" in crashed.error and crashed.meta()["infra_failure"] is True

    sandbox = SessionResult("t", 1, "s2", cause="error:sandbox", error="SandboxError: boom")
    sandbox.take_verdict({"cause": "error:sandbox", "infra_failure": True})
    assert (sandbox.cause, sandbox.scaffold_cause, sandbox.error) == (
        "error:sandbox", "", "SandboxError: boom")   # already Undertow's: as it was
    exited = SessionResult("t", 2, "s3", cause="exited", reward=1.0)
    exited.take_verdict({"cause": "exited", "infra_failure": False})
    assert (exited.cause, exited.infra_failure) == ("exited", False)
