"""`undertow train` end to end: real built-in engine, real gateway, the learner, and a
scripted rollout source (`scripted_rollouts.py`); two steps, then a SIGTERM + resume
run that must end with the weights of the uninterrupted one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from undertow.learner.checkpoint import latest_checkpoint
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420


def _command(run_dir: Path, model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "undertow.cli", "train", "--run-dir", str(run_dir),
            f"run.model_dir={model_dir}", "learner.num_steps=2", "learner.group_size=2",
            "learner.max_staleness=0", "learner.lr=0.001", "learner.checkpoint_every=1",
            "rollout.source=tests.e2e.scripted_rollouts:make_run_group", *extra]


def _start(command: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ,
                                                             "PYTHONPATH": str(REPO)})


def _finish(process: subprocess.Popen, log: Path) -> int:
    try:
        return process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"undertow train did not finish; its log:\n{log.read_text()[-3000:]}")


def _weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train") / "run"
    log = run_dir.parent / "train.log"
    code = _finish(_start(_command(run_dir, tiny_model_dir), log), log)
    assert code == 0, log.read_text()[-3000:]
    return run_dir


def test_two_steps_train_on_gateway_trees_and_publish_versions(straight_run):
    records = read_metrics(straight_run)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2)]
    assert all(r["num_sessions"] == 2 and r["num_trained_tokens"] > 0 for r in records)
    assert all(r["reward_mean"] == 0.5 and r["pass_rate"] == 0.5 for r in records)
    # The engine sampled with the weights the learner scores with: the logprobs differ by
    # rounding only (a token scored from the wrong position would be off by nats).
    for record in records:
        assert 0 <= record["mismatch_mean"] <= record["mismatch_max"] < 1e-2, record
        assert record["ratio_p5"] <= record["ratio_p50"] <= record["ratio_p95"]
        assert abs(record["ratio_p50"] - 1) < 1e-2 and record["masked_fraction"] == 0
    assert latest_checkpoint(straight_run).name == "step-000002"
    trees = load_store_trees(straight_run / "store")
    versions = {tree.group_id: {v for n in tree.nodes.values() if n.trainable
                                for v in n.weight_versions} for tree in trees}
    # The second group sampled with the weights the first step pushed to the engine.
    assert versions == {"g000000-r0": {0}, "g000001-r0": {1}}
    config = (latest_checkpoint(straight_run) / "config.yaml").read_text()
    assert "group_size: 2" in config and "max_staleness: 0" in config


def test_plot_writes_pngs(straight_run):
    result = subprocess.run([sys.executable, "-m", "undertow.cli", "plot", str(straight_run)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    paths = [Path(line) for line in result.stdout.split()]
    assert {p.name for p in paths} == {"reward.png", "loss.png", "tokens.png", "mismatch.png",
                                      "time.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_sigterm_then_resume_ends_like_the_uninterrupted_run(straight_run, tiny_model_dir,
                                                             tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    process = _start(_command(run_dir, tiny_model_dir), log)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not read_metrics(run_dir) and process.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert _finish(process, log) == 143, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert [r["step"] for r in read_metrics(run_dir)] == [1]

    resumed = _start(_command(run_dir, tiny_model_dir, "--resume"), log)
    assert _finish(resumed, log) == 0, log.read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    state = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())
    assert state["step"] == 2 and state["num_resumes"] == 1
    expected, got = _weights(straight_run), _weights(run_dir)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert got[name].equal(value), name


@pytest.mark.docker
@pytest.mark.agents
def test_default_rollouts_mini_swe_agent_in_docker_two_steps(tiny_model_dir, tmp_path):
    """The SWE run (`configs/swe.yaml`): the real mini-swe-agent on one bundled task in
    Docker sandboxes, graded; every session ends closed with a reward in the tree the
    learner trained on."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    command = [sys.executable, "-m", "undertow.cli", "train", "--run-dir", str(run_dir),
               "-c", str(REPO / "undertow" / "configs" / "swe.yaml"),
               f"run.model_dir={tiny_model_dir}", "learner.num_steps=2",
               "learner.group_size=2", "rollout.num_tasks=1", "rollout.timeout_s=180",
               "rollout.scaffold_options={step_limit: 2, max_tokens: 32}"]
    code = _finish(_start(command, log), log)
    assert code == 0, log.read_text()[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["num_sessions"] == 2 and r["num_trained_tokens"] > 0 for r in records)
    trees = load_store_trees(run_dir / "store")
    assert len(trees) == 2
    for tree in trees:
        assert len(tree.sessions) == 2
        assert all(p.closed and p.reward is not None for p in tree.sessions.values())


def test_resume_reads_groups_finished_before_a_crash_back_from_the_store(straight_run,
                                                                        tiny_model_dir,
                                                                        tmp_path):
    """A crash after group 1 finished but before step 2's checkpoint (here: that
    checkpoint removed): the resumed run trains group 1 as read back from the gateway's
    store, runs no new session, and ends with the uninterrupted run's weights."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    shutil.copytree(straight_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-000002")
    resumed = _start(_command(run_dir, tiny_model_dir, "--resume"), log)
    assert _finish(resumed, log) == 0, log.read_text()[-3000:]
    assert "group g000001-r0 (launch 1) finished before the restart" in log.read_text()
    assert sorted(t.group_id for t in load_store_trees(run_dir / "store")) == [
        "g000000-r0", "g000001-r0"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    expected, got = _weights(straight_run), _weights(run_dir)
    for name, value in expected.items():
        assert got[name].equal(value), name
