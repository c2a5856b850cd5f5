"""A start of a run (`Learner.begin_run`, then the trackers opened as
`undertow/run/train.py` opens them) over what a dead start
left: the logs hold each step once (cut back to the checkpoint resumed), the start takes a
number no earlier start used, and the dead start's weights and temporaries are gone."""

import json
import subprocess
import sys

import pytest

from undertow.learner.checkpoint import STARTS_FILE
from undertow.learner.config import AdvantageConfig, LossConfig, TrackerConfig, TrainConfig
from undertow.learner.metrics_log import METRICS_FILE, read_metrics
from undertow.learner.trackers import (
    STEPS_FILE,
    TrackedMetricsLog,
    Trackers,
    open_trackers,
    truncate_steps,
)
from undertow.learner.train import Learner, group_id_of

from .conftest import build_random_tree

pytestmark = pytest.mark.slow


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _open_trackers(learner: Learner) -> Trackers:
    """What `undertow train` does at a start: the steps log cut back to the checkpoint, then
    the trackers opened."""
    truncate_steps(learner.run_dir, learner.state.step)
    return open_trackers(TrackerConfig(), learner.run_dir, {}, lambda: learner.state.consumed)


def _dead_start(run_dir, num_steps: int) -> None:
    """What a start that died at step `num_steps` wrote past its checkpoint."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(run_dir / METRICS_FILE, "a") as metrics, open(run_dir / STEPS_FILE, "a") as steps:
        for step in range(2, num_steps + 1):
            metrics.write(json.dumps({"step": step, "weight_version": step, "loss": 9.0}) + "\n")
            steps.write(json.dumps({"step": step, "indices": [step - 1],
                                    "group_ids": [group_id_of(step - 1, 0)]}) + "\n")
        steps.write('{"step": 6, "ind')   # torn by the kill
    for step in range(2, num_steps + 1):
        (run_dir / "weights" / f"step-{step:06d}").mkdir(parents=True)
    (run_dir / "weights" / f".tmp-step-{num_steps + 1:06d}-{dead.pid}").mkdir()


def test_a_resume_over_a_dead_start_logs_each_step_once_under_a_new_number(tiny_model_dir,
                                                                             tmp_path):
    config = TrainConfig(lr=1e-3, checkpoint_every=1)
    learner = Learner(config, LossConfig(), AdvantageConfig(), tiny_model_dir, tmp_path)
    learner.begin_run()
    trackers = _open_trackers(learner)
    learner.train_step([build_random_tree(3, "g000000-r0")])
    learner.state.consumed = [0]
    TrackedMetricsLog(learner.run_dir, trackers).append(1, 1, {"loss": 1.0})
    learner.save(checkpoint=True)
    trackers.close()
    _dead_start(tmp_path, 5)

    for expected_number in (1, 2):   # the second resume dies, like the first, uncheckpointed
        resumed = Learner.restore(config, LossConfig(), AdvantageConfig(), tiny_model_dir,
                                  tmp_path)
        resumed.begin_run()
        _open_trackers(resumed).close()
        assert resumed.state.step == 1 and resumed.state.num_resumes == expected_number
        assert [r["step"] for r in read_metrics(tmp_path)] == [1]
        assert [r["step"] for r in _lines(tmp_path / STEPS_FILE)] == [1]
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == []
        _dead_start(tmp_path, 3)
    assert json.loads((tmp_path / STARTS_FILE).read_text()) == {"num_starts": 3}
