"""Learning a multi-turn task, end to end and without Docker: `undertow train` on
SmolLM2-135M-Instruct (built-in engine, gateway, learner, weights pushed every step) with
`rollout.scaffold: chat-multiturn` (`adapters/chat_multiturn.py`) on the lookup tasks of
`adapters/configs/lookup.yaml`.

Each session is two chat calls: the first should call `lookup(KEY)` for the task's key,
the rollout answers with a tool message holding a value drawn per session (10-99), and
the second call is rewarded only if it replies with that value. Probed with transformers'
`generate` at temperature 1 (32 samples a variant, 7 December): with no solved example
the start policy called lookup with the right key 0 times in 32; with one, 8 in 32, and
given the tool's value it copied it 32 times in 32; with two, 27 in 32. The task set
has one example, so the start pass rate is about a quarter and what RL must raise is
calling lookup with the asked key, which pays only through the tool's answer.

Three arms, one `undertow train` each, same seed:
- "learns": as above; the pass rate rises well above its start;
- "flipped": the reward is 1 minus the above, which, as the group normalises rewards,
  is the advantages' sign flipped: the rate of right answers falls;
- "dropped": the tool message is sent without its content (`drop_tool_result`): the
  value cannot be guessed (1 in 90), the reward stays near 0 and nothing is learned.

As in `test_learning_smollm2.py`, what is measured is what the policy sampled, read back
from the gateway's store: the start is every session sampled by the start weights
(version 0), the end the last two groups. Measured (7 December, groups of 8, lr 2e-5, 4
steps, at load 7-20 on 2 cores): "learns" answered 2, 4, 6 and 8 of 8 in the groups of
versions 0-3 and then 8 of 8 (12 min; the learner's step 110-200 s of each step's
130-210 s); "flipped" 2 of 8 at version 0, then 0 in every group (7 min); "dropped" 0 in
every group (7 min); the three arms 26 min in all.
"""

import statistics
from pathlib import Path

import pytest
import yaml

from tests.processes import run_train
from undertow.adapters.rewards import exact_answer
from undertow.learner.advantages import valid_sessions
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trees import load_store_trees

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2300
NUM_STEPS = 4
NUM_END_GROUPS = 2
MAX_START = 0.75
MIN_END = 0.75
ARMS = {"learns": {}, "flipped": {"flip": True}, "dropped": {"drop_tool_result": True}}


def missed_answer(messages, task) -> float:
    """The flipped arm's reward: 1 where `exact_answer` pays 0 and 0 where it pays 1."""
    return 1.0 - exact_answer(messages, task)


def _tasks(path: Path, flip: bool) -> Path:
    rows = yaml.safe_load((REPO / "adapters" / "configs" / "lookup.yaml").read_text())
    if flip:
        for row in rows:
            row["reward"] = "tests.e2e.test_learning_multiturn:missed_answer"
    path.write_text(yaml.safe_dump(rows))
    return path


def _train(run_dir: Path, model_dir: Path, tasks: Path, log: Path, drop: bool) -> int:
    return run_train(run_dir, [
        f"run.model_dir={model_dir}", "rollout.scaffold=chat-multiturn",
        f"rollout.tasks={tasks}", "rollout.concurrency=8",
        *(["rollout.scaffold_options.drop_tool_result=true"] if drop else []),
        "warm_start.num_steps=0", f"learner.num_steps={NUM_STEPS}", "learner.lr=2e-5",
        "learner.group_size=8", "learner.checkpoint_every=100"], log, TIMEOUT_S)


def _sampled_groups(run_dir: Path, flip: bool) -> list[tuple[str, list[float], set[int]]]:
    """Per group in launch order: whether each valid session answered the value (its
    reward, un-flipped), and the weight versions that sampled the group. Every session
    is two calls."""
    groups = []
    for tree in sorted(load_store_trees(run_dir / "store"), key=lambda t: t.group_id):
        sessions = valid_sessions(tree)
        calls = [sum(call.session_id == s for call in tree.calls) for s in sessions]
        assert calls == [2] * len(sessions), (tree.group_id, calls)
        versions = {v for node in tree.nodes.values() if node.trainable
                    for v in node.weight_versions}
        answered = [1.0 - r if flip else r for r in sessions.values()]
        groups.append((tree.group_id, answered, versions))
    return groups


@pytest.mark.parametrize("arm", list(ARMS))
def test_smollm2_learns_a_lookup_only_through_the_tool_result(smollm2_dir, tmp_path, arm):
    flip, drop = ARMS[arm].get("flip", False), ARMS[arm].get("drop_tool_result", False)
    tasks, run_dir, log = tmp_path / "lookup.yaml", tmp_path / "run", tmp_path / "train.log"
    code = _train(run_dir, smollm2_dir, _tasks(tasks, flip), log, drop)
    assert code == 0, log.read_text()[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, NUM_STEPS + 1))
    groups = _sampled_groups(run_dir, flip)
    start = statistics.fmean(r for _, answered, versions in groups if versions == {0}
                             for r in answered)
    end = statistics.fmean(r for _, answered, _ in groups[-NUM_END_GROUPS:] for r in answered)
    report = f"{arm}: start {start:.3f}, end {end:.3f}; groups " + str(
        [(g, statistics.fmean(answered), sorted(v)) for g, answered, v in groups])
    print(report)   # shown with -rP: the figures of a passing run too
    assert min(v for _, _, versions in groups[-NUM_END_GROUPS:] for v in versions) >= \
        NUM_STEPS - 2, report
    if arm == "learns":
        # The start is one group of 8, so it scatters: runs here gave 2, 4 and 4 of 8 (about
        # 0.4, above the probe's 1 in 4); at 0.4, 5 of 8 or more comes 1 run in 6, 7 or more
        # 1 in 120. So this run's start is only checked not to be most of the group, and the
        # learning is judged by the end (16 sessions) against a fixed bar well above the
        # start policy's rate. Runs here ended at 0.875, 0.938 and 1.0.
        assert start <= MAX_START and end >= MIN_END, report
    elif arm == "flipped":
        assert end <= start / 2, report
    else:
        assert end < 0.1 and start < 0.1, report
