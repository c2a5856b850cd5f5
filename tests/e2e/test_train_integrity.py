"""Reward integrity of `undertow train`, with failures injected for real: chat sessions
(real engine, real gateway) on a prompt task set whose reward function crashes on
every third call (`faulty_rewards.py`), or always. Failed sessions must be re-run,
counted by cause in metrics.jsonl and the progress line, and never trained; a group
left with fewer than two valid sessions is dropped and replaced; a run whose every
session fails stops with one clear error, not a traceback."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from undertow.learner.advantages import valid_sessions
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def _tasks(tmp_path: Path, reward: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"instance_id": "short", "prompt": "Say something short.",
                                "reward": f"tests.e2e.faulty_rewards:{reward}",
                                "counter": str(tmp_path / "calls")}) + "\n")
    return path


def _train(tmp_path: Path, model_dir: Path, reward: str, *extra: str
           ) -> tuple[int, str, Path]:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "undertow.cli", "train", "--run-dir", str(run_dir),
               f"run.model_dir={model_dir}", f"rollout.tasks={_tasks(tmp_path, reward)}",
               "warm_start.num_steps=0", "advantages.filter_uniform_groups=false", *extra]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"undertow train did not finish:\n{output[-3000:]}")
    return process.returncode, output, run_dir


def test_crashed_grading_is_rerun_counted_and_never_trained(tiny_model_dir, tmp_path):
    code, output, run_dir = _train(tmp_path, tiny_model_dir, "every_third_crashes",
                                   "learner.num_steps=3", "learner.group_size=4",
                                   "rollout.max_attempts=3")
    assert code == 0, output[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    # Every step trained its 4 slots, each on a real outcome, after the re-runs.
    assert all(r["num_sessions"] == 4 for r in records), records
    failed = sum(r["num_infra_failures"] for r in records)
    assert failed >= 3 and sum(r["num_rerun_sessions"] for r in records) == failed
    assert all(set(r["infra_failures"]) <= {"error:reward"} for r in records)
    assert "failed: error:reward" in output

    trees = load_store_trees(run_dir / "store")
    crashed = [p for t in trees for p in t.sessions.values() if p.meta.get("infra_failure")]
    assert len(crashed) == failed
    assert all(p.meta["cause"] == "error:reward" and "grader crashed" in p.meta["error"]
               for p in crashed)
    assert all(len(valid_sessions(t)) == 4 for t in trees)


def test_a_group_left_with_one_valid_session_is_dropped_and_replaced(tiny_model_dir,
                                                                       tmp_path):
    code, output, run_dir = _train(tmp_path, tiny_model_dir, "every_third_crashes",
                                   "learner.num_steps=2", "learner.group_size=2",
                                   "rollout.max_attempts=1")
    assert code == 0, output[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_sessions"] == 2 for r in records)
    assert sum(r["num_dropped_invalid"] for r in records) >= 2
    assert "1 valid session(s) left; Undertow failed {'error:reward': 1}" in (
        run_dir / "train.log").read_text()   # the run's log: the output counts it
    trees = load_store_trees(run_dir / "store")
    assert len(trees) == 2 + sum(r["num_dropped_invalid"] for r in records)


def test_a_run_whose_every_session_fails_stops_with_one_clear_error(tiny_model_dir,
                                                                     tmp_path):
    code, output, run_dir = _train(tmp_path, tiny_model_dir, "always_crashes",
                                   "learner.num_steps=2", "learner.group_size=2",
                                   "rollout.max_attempts=2", "learner.max_failed_groups=2")
    assert code == 1, output[-3000:]
    assert "Traceback" not in output
    (line,) = [t for t in output.splitlines() if t.startswith("undertow train: error:")]
    assert "every session failed with error:reward" in line
    assert "the grading command is broken" in line and "always_crashes" in line
    assert read_metrics(run_dir) == []
