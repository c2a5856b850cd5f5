"""A resumed run in the run viewer (`undertow/ui/runs.py`): one record per step, and the
groups a step trained, even from logs written before a start cut them back (a step's last
line is the one trained)."""

import json
import os

from undertow.learner.metrics_log import METRICS_FILE
from undertow.learner.trackers import STEPS_FILE
from undertow.ui.runs import RunFolder


def test_the_viewer_shows_each_step_once_and_the_groups_it_trained(tmp_path):
    """A log written before resumes cut it back: the last line of a step is the one trained."""
    run_dir = tmp_path / "run"
    (run_dir / "store").mkdir(parents=True)
    for group in ("g000000-r0", "g000001-r0", "g000001-r1"):
        (run_dir / "store" / f"{group}.jsonl").write_text("")
    records = [{"step": 1, "weight_version": 1, "loss": 1.0},
               {"step": 2, "weight_version": 2, "loss": 9.0},
               {"step": 2, "weight_version": 2, "loss": 2.0}]
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / STEPS_FILE).write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "indices": [0], "group_ids": ["g000000-r0"]},
        {"step": 2, "indices": [1], "group_ids": ["g000001-r0"]},
        {"step": 2, "indices": [1], "group_ids": ["g000001-r1"]})))
    folder = RunFolder("run", run_dir)
    shown, problems = folder.metrics()
    assert problems == [] and [(r["step"], r["loss"]) for r in shown] == [(1, 1.0), (2, 2.0)]
    assert folder.step_groups(2) == (["g000001-r1"], "recorded")
    os.remove(run_dir / "store" / "g000001-r1.jsonl")   # not in the store: by launch index
    assert folder.step_groups(2) == (["g000001-r0"], "recorded")
