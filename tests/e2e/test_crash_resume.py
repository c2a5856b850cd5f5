"""`undertow train` killed hard (SIGKILL of its process group) at five moments, resumed
each time with `--resume`, must finish as if nothing happened: every step once in
`metrics.jsonl` and `steps.jsonl`, every launch index trained once (no group lost beyond
those in flight), no group name used by two starts, and no process left behind (the
engine each start began ends with it; the gateway runs in the killed process).

The default tiny-model chat run (`configs/learn.yaml`: real built-in engine, real gateway,
one chat call per session on the directions task set), kept short: 6 steps of one group of
4, a checkpoint every 2 steps, no warm start. Each moment is reached exactly through the
test's rollout source (`crash_points.py`), which stops the run dead there:

| start | killed                                     | it resumes from                      |
| ----- | ------------------------------------------ | ------------------------------------ |
| 1     | in rollout: group 1 done, not yet collected | (a new run)                          |
| 2     | in the learner's step 2                    | no checkpoint: step 0, groups 0-1    |
|       |                                            | read back from the store             |
| 3     | in the checkpoint write of step 2          | no checkpoint                        |
| 4     | in the weight push of step 3               | no checkpoint (a dead PID's .tmp-*)  |
| 5     | in rollout of group 3, before its own      | checkpoint 2, weights/step-000003 of |
|       | checkpoint                                 | a dead start past it                 |
| 6     | runs to the end                            | checkpoint 2 again                   |
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import REPO, alive, descendants
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trackers import GROUP_NAME, STEPS_FILE
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.slow

TIMEOUT_S = 420
NUM_STEPS, GROUP_SIZE = 6, 4
MOMENTS = ("rollout:1", "train:2", "checkpoint:2", "push:3", "rollout:3")


def _command(run_dir: Path, model_dir: Path, resume: bool) -> list[str]:
    return [sys.executable, "-m", "undertow.cli", "train", "--run-dir", str(run_dir),
            *(["--resume"] if resume else []), f"run.model_dir={model_dir}",
            "warm_start.num_steps=0", f"learner.num_steps={NUM_STEPS}",
            f"learner.group_size={GROUP_SIZE}", "learner.checkpoint_every=2",
            "advantages.filter_uniform_groups=false",
            "rollout.source=tests.e2e.crash_points:make_run_group"]


def _start(command: list[str], log: Path, hang: str) -> subprocess.Popen:
    with open(log, "ab") as handle:
        handle.write(f"\n=== {' '.join(command[3:])} (hang {hang or '-'})\n".encode())
        return subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO),
                                     "UNDERTOW_TEST_HANG": hang})


def _kill_at(process: subprocess.Popen, log: Path, moment: str) -> None:
    """Waits until the run prints that it stopped at `moment`, then SIGKILLs its process
    group; fails unless every process it started (engine, watchdog) ends with it."""
    marker = f"HANG {moment.replace(':', ' ')}"
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while marker not in log.read_text(errors="replace"):
            assert process.poll() is None, f"ended before {moment}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"never reached {moment}:\n{_tail(log)}"
            time.sleep(0.2)
        started = descendants(process.pid)
        assert started, "the run has no engine process"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + TIMEOUT_S
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(started) == set(), f"left running after the kill at {moment}"


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_at_five_moments_and_resumed_it_finishes_as_one_run(tiny_model_dir,
                                                                    tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    for number, moment in enumerate(MOMENTS):
        _kill_at(_start(_command(run_dir, tiny_model_dir, resume=number > 0), log, moment),
                 log, moment)
        if moment == "checkpoint:2":
            assert list((run_dir / "checkpoints").glob(".tmp-step-000002-*"))
        if moment == "push:3":
            assert (run_dir / "weights" / "step-000003").is_dir()
    final = _start(_command(run_dir, tiny_model_dir, resume=True), log, "")
    try:
        code = final.wait(timeout=TIMEOUT_S)
    finally:
        if final.poll() is None:
            os.killpg(final.pid, signal.SIGKILL)
            final.wait()
    assert code == 0, _tail(log)

    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, NUM_STEPS + 1))
    steps = _lines(run_dir / STEPS_FILE)
    assert [r["step"] for r in steps] == list(range(1, NUM_STEPS + 1))
    assert [index for r in steps for index in r["indices"]] == list(range(NUM_STEPS))
    assert json.loads((run_dir / "starts.json").read_text()) == {"num_starts": 6}

    trees = {tree.group_id: tree for tree in load_store_trees(run_dir / "store")}
    for tree in trees.values():   # a name two starts used would hold both starts' sessions
        assert len(tree.sessions) <= GROUP_SIZE, (tree.group_id, sorted(tree.sessions))
    numbers = {int(GROUP_NAME.match(name).group(2)) for name in trees}  # type: ignore[union-attr]
    assert numbers <= set(range(6)) and len(numbers) >= 4
    for record in steps:   # what each step trained: whole groups of the store
        (group_id,) = record["group_ids"]
        assert sum(p.closed for p in trees[group_id].sessions.values()) == GROUP_SIZE
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert "Writing model shards" not in log.read_text(errors="replace")   # issue 38
