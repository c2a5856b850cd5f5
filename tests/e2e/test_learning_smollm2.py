"""Learning from a pretrained policy, end to end and without Docker: `undertow train` on
SmolLM2-135M-Instruct (built-in engine, gateway, one-call chat sessions, learner, the
weights pushed every step) on a prompt task whose answer a reward function checks.

The task is one the start policy solves some of the time, so that a group of 16 has
reward variance from the first step (a random model learns nothing in minutes,
../shared/MEASUREMENTS.md): a few-shot sum, "What is 4 + 2?", after two solved examples
that make the policy reply with a bare number; `exact_answer` pays 1 only for "6".
Sampled at temperature 1 the start policy replies "6" about a sixth of the time (5 of
32 samples by transformers' `generate`; 3 and 4 of 16 in the first two steps of a run).
GRPO at lr 1e-5 took the reward from 0.19 to 0.94 within four steps (this test's run
at 5 steps: start 0.125, end 0.97; 12 minutes at load 16-20 on 2 cores, 1-3 minutes a
step, most of it the learner's step on the 135M model). Four steps are enough, and a
fifth is the dearest: a 5-step run (lr 1e-5, 6 December) sampled 0.06, 0.19, 0.75, 0.94
with versions 0-3, so this test's end at 4 steps (the groups of versions 2 and 3) was
0.84; its fifth step drew three groups, the first two all 1.0 and dropped as uniform,
and took 190 of the run's 734 s (niced, beside other work at load 12-15). Rewarding every
other reply instead (the same as flipping the advantages' sign, since the group
normalises the rewards) took the "6" rate from 0.19 to 0 in one step, so this test
fails on a sign error.

As in `test_learning.py`, what is measured is what the policy sampled, read back from
the gateway's store (also the groups dropped as uniform, which the step's metrics leave
out): the start is every session sampled by the start weights (version 0), the end the
last two groups. PYTHONPATH is passed on, so that a deliberately broken variant can be
tried.
"""

import statistics
from pathlib import Path

import pytest
import yaml

from tests.processes import run_train
from undertow.learner.advantages import valid_sessions
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trees import load_store_trees

# A few minutes alone; a step took 2-4 minutes on this 2-core machine at load 16-22.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2300
NUM_STEPS = 4
NUM_END_GROUPS = 2
MARGIN = 0.4
QUESTION = "What is {} + {}? Reply with only the number."
TASK = {
    "instance_id": "add-4-2",
    "messages": [{"role": "user", "content": QUESTION.format(2, 2)},
                 {"role": "assistant", "content": "4"},
                 {"role": "user", "content": QUESTION.format(3, 5)},
                 {"role": "assistant", "content": "8"},
                 {"role": "user", "content": QUESTION.format(4, 2)}],
    "answer": "6",
    "reward": "undertow.adapters.rewards:exact_answer",
}


def _train(run_dir: Path, model_dir: Path, tasks: Path, log: Path) -> int:
    return run_train(run_dir, [
               f"run.model_dir={model_dir}", f"rollout.tasks={tasks}",
               "warm_start.num_steps=0", f"learner.num_steps={NUM_STEPS}", "learner.lr=1e-5",
               "learner.checkpoint_every=100"], log, TIMEOUT_S)


def _sampled_groups(run_dir: Path) -> list[tuple[str, list[float], set[int]]]:
    """Per group in launch order: its valid sessions' rewards and the weight versions
    that sampled it."""
    groups = []
    for tree in sorted(load_store_trees(run_dir / "store"), key=lambda t: t.group_id):
        versions = {v for node in tree.nodes.values() if node.trainable
                    for v in node.weight_versions}
        groups.append((tree.group_id, list(valid_sessions(tree).values()), versions))
    return groups


def test_smollm2_reward_on_a_checked_answer_rises_well_above_its_start(smollm2_dir, tmp_path):
    tasks, run_dir, log = tmp_path / "add.yaml", tmp_path / "run", tmp_path / "train.log"
    tasks.write_text(yaml.safe_dump([TASK]))
    code = _train(run_dir, smollm2_dir, tasks, log)
    assert code == 0, log.read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, NUM_STEPS + 1))
    groups = _sampled_groups(run_dir)
    start = statistics.fmean(r for _, rewards, versions in groups if versions == {0}
                             for r in rewards)
    end = statistics.fmean(r for _, rewards, _ in groups[-NUM_END_GROUPS:] for r in rewards)
    report = f"start {start:.3f}, end {end:.3f}; groups " + str(
        [(g, statistics.fmean(rewards), sorted(v)) for g, rewards, v in groups])
    # About 1/6 of the start policy's replies are "6" (module docstring).
    assert start < 0.5 and end >= start + MARGIN, report
    assert min(v for _, _, versions in groups[-NUM_END_GROUPS:] for v in versions) >= \
        NUM_STEPS - 2, report
