"""`undertow train` on three CPU cells with the elastic policy, end to end: real built-in
engines (one per rollout cell) behind the real gateway, the paced scripted rollouts
(`paced_rollouts.py`, one slow session per group), learner members in their own
processes. Cells move to training while the slow session runs and come back with the new
weights; each step's gradient is computed by the members; two steps, two versions. Then
`undertow train --resume` continues the run for a third step: every cell's engine starts
on the checkpoint's weights, so the new group samples with version 2."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from undertow.learner.checkpoint import latest_checkpoint
from undertow.learner.metrics_log import read_metrics
from undertow.learner.pool.live import read_timeline
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
NUM_TURNS = 2


def _train(arguments, log):
    """Runs `undertow train ARGUMENTS` to its end; fails the test with its log if not 0."""
    command = [sys.executable, "-m", "undertow.cli", "train", *arguments]
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        code = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"undertow train did not finish; its log:\n{log.read_text()[-3000:]}")
    assert code == 0, log.read_text()[-3000:]


def test_elastic_pool_run_moves_cells_trains_and_resumes(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    _train(["--run-dir", str(run_dir), f"run.model_dir={tiny_model_dir}", "learner.num_steps=2",
            "learner.group_size=4", "learner.lr=0.001",
            "rollout.source=tests.e2e.paced_rollouts:make_run_group",
            f"rollout.scaffold_options={{num_turns: {NUM_TURNS}, max_tokens: 8, "
            "tool_latency_s: [0.0, 0.0, 0.5, 4.0]}",
            "pool.policy=elastic", "pool.num_cells=3", "pool.num_session_slots=2"],
           tmp_path / "train.log")

    records = read_metrics(run_dir)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2)]
    assert all(r["num_members"] >= 1 and r["num_trained_tokens"] > 0 for r in records)
    assert all(r["num_sessions"] == 4 and r["reward_mean"] == 0.25 for r in records)
    assert latest_checkpoint(run_dir).name == "step-000002"

    events = read_timeline(run_dir)
    to_training = [e["cell_id"] for e in events if e["event"] == "MoveToTraining"]
    to_rollout = [e["cell_id"] for e in events if e["event"] == "MoveToRollout"]
    assert len(to_training) >= 2 and to_rollout  # cells went to training and came back
    assert [e["step"] for e in events if e["event"] == "DispatchBatch"] == [0, 1]
    published = [e for e in events if e["event"] == "published"]
    assert [e["weight_version"] for e in published] == [1, 2]
    assert all(e["num_members"] >= 1 for e in published)
    # Before each publish, at least one cell was training (its member computed the step).
    assert all("training" in e["cells"].values() for e in published)

    trees = {tree.group_id: tree for tree in load_store_trees(run_dir / "store")}
    assert sorted(trees) == ["g000000-r0", "g000001-r0"]
    for group_id, version in (("g000000-r0", 0), ("g000001-r0", 1)):
        tree = trees[group_id]
        assert len(tree.sessions) == 4
        assert all(p.closed for p in tree.sessions.values())
        # One call per turn, however the session's engine changed: no reply was split.
        calls = [call.session_id for call in tree.calls]
        assert sorted(calls.count(s) for s in tree.sessions) == [NUM_TURNS] * 4
        assert {v for n in tree.nodes.values() if n.trainable
                for v in n.weight_versions} == {version}

    _train(["--run-dir", str(run_dir), "--resume", "learner.num_steps=3"],
           tmp_path / "resume.log")
    records = read_metrics(run_dir)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2), (3, 3)]
    assert latest_checkpoint(run_dir).name == "step-000003"
    starts = [e["step"] for e in read_timeline(run_dir) if e["event"] == "start"]
    assert starts == [0, 2]
    tree = {t.group_id: t for t in load_store_trees(run_dir / "store")}["g000002-r1"]
    assert all(p.closed for p in tree.sessions.values()) and len(tree.sessions) == 4
    assert {v for n in tree.nodes.values() if n.trainable for v in n.weight_versions} == {2}
