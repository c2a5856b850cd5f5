"""`undertow train` on three CPU cells with the elastic policy, end to end: real built-in
engines (one per rollout cell) behind the real gateway, the paced scripted rollouts
(`paced_rollouts.py`, one slow session per group), learner members in their own
processes. Cells move to training while the slow session runs and come back with the new
weights; each step's gradient is computed by the members; two steps, two versions. Then
`undertow train --resume` continues the run for a third step: every cell's engine starts
on the checkpoint's weights, so the new group samples with version 2. (The two-step run is
the session's `elastic_pool_run`, tests/conftest.py, which tests/ui/test_viewer.py draws.)

Reward integrity and records in a pool run: real chat sessions (`ChatRollout`, the real
gateway and engines) whose rewards come from this module's reward functions
(`planned_chat_rollouts`): a uniform group and a group whose grader crashes on all but
one session are dropped and replaced, counted in `metrics.jsonl`, the progress lines,
`steps.jsonl` and TensorBoard's event files as a plain run counts them; a run whose
every grading crashes stops with one line naming the cause, exit code 1."""

import asyncio
import json
import shutil

import pytest

from tests.conftest import POOL_RUN_NUM_TURNS, run_train
from undertow.cells.loop import read_timeline
from undertow.learner.checkpoint import latest_checkpoint
from undertow.learner.metrics_log import read_metrics
from undertow.learner.trees import load_store_trees

pytestmark = pytest.mark.slow

def test_elastic_pool_run_moves_cells_trains_and_resumes(elastic_pool_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(elastic_pool_run, run_dir)

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
        assert sorted(calls.count(s) for s in tree.sessions) == [POOL_RUN_NUM_TURNS] * 4
        assert {v for n in tree.nodes.values() if n.trainable
                for v in n.weight_versions} == {version}

    run_train(["--run-dir", str(run_dir), "--resume", "learner.num_steps=3"],
              tmp_path / "resume.log")
    records = read_metrics(run_dir)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2), (3, 3)]
    assert latest_checkpoint(run_dir).name == "step-000003"
    starts = [e["step"] for e in read_timeline(run_dir) if e["event"] == "start"]
    assert starts == [0, 2]
    tree = {t.group_id: t for t in load_store_trees(run_dir / "store")}["g000002-r1"]
    assert all(p.closed for p in tree.sessions.values()) and len(tree.sessions) == 4
    assert {v for n in tree.nodes.values() if n.trainable for v in n.weight_versions} == {2}


PROMPT = ({"role": "user", "content": "Name one direction: up, down, left or right."},)
# A group of each kind: the reward function of each of its sessions (the rest repeat
# the last). "crashing": the grader raises on all but one session, on every attempt.
KINDS = {"normal": ("reward_one", "reward_zero"), "uniform": ("reward_one",),
         "crashing": ("reward_one", "reward_crash"), "dead": ("reward_crash",)}


def reward_one(messages, task):
    return 1.0


def reward_zero(messages, task):
    return 0.0


def reward_crash(messages, task):
    raise RuntimeError("the grader crashed")


def planned_chat_rollouts(context):
    """`rollout.source`: launch i runs `scaffold_options.plan[i]` (else `default`) of
    `KINDS`, each session one real chat call (`ChatRollout`, which re-runs the sessions
    Undertow failed up to `rollout.max_attempts`) rewarded by its function."""
    from undertow.adapters.chat_rollout import ChatRollout, ChatRolloutConfig, PromptTask
    from undertow.adapters.gateway_client import GatewayAdmin
    from undertow.run.rollout_source import outcome_of

    options = dict(context.rollout.scaffold_options)
    plan = {int(index): kind for index, kind in options.get("plan", {}).items()}

    async def run_group(request):
        functions = KINDS[plan.get(request.index, options.get("default", "normal"))]
        slots = [functions[min(i, len(functions) - 1)] for i in range(request.group_size)]
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            results = await asyncio.gather(*(
                ChatRollout(admin, ChatRolloutConfig(
                    group_size=slots.count(name), max_tokens=4,
                    max_attempts=context.rollout.max_attempts)).run_group(
                        PromptTask(name, PROMPT, f"{__name__}:{name}"), request.group_id)
                for name in sorted(set(slots))))
        return outcome_of(request.group_id, [r for part in results for r in part])
    return run_group


def _planned_run(tiny_model_dir, run_dir, plan):
    return ["--run-dir", str(run_dir), f"run.model_dir={tiny_model_dir}", "learner.lr=0.001",
            "learner.group_size=3", "learner.groups_per_step=2", "rollout.max_attempts=2",
            f"rollout.source={__name__}:planned_chat_rollouts",
            f"rollout.scaffold_options={plan}", "pool.policy=elastic", "pool.num_cells=2",
            "pool.num_session_slots=2"]


def test_pool_run_drops_and_replaces_groups_and_records_steps_as_a_plain_run(
        tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from undertow.ui.runs import RunFolder

    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    run_train([*_planned_run(tiny_model_dir, run_dir, "{plan: {0: uniform, 1: crashing}}"),
               "learner.num_steps=2", "advantages.filter_uniform_groups=true",
               "advantages.max_extra_groups=1", "logging.trackers=[tensorboard]"], log)

    first, second = records = read_metrics(run_dir)
    assert [(r["step"], r["weight_version"]) for r in records] == [(1, 1), (2, 2)]
    assert (first["num_dropped_uniform"], first["num_dropped_invalid"]) == (1, 1)
    # Two crashing slots, each tried twice (one re-run each), in a group left with one.
    assert first["infra_failures"] == {"error:reward": 4} and first["num_rerun_sessions"] == 2
    assert (second["num_dropped_uniform"], second["num_dropped_invalid"]) == (0, 0)
    for record in records:   # two normal groups trained: one session of three rewarded
        assert record["num_groups"] == 2 and record["num_sessions"] == 6
        assert record["reward_mean"] == pytest.approx(1 / 3)
        assert record["kl"] > -1e-6 and record["entropy"] > 0 and record["num_members"] >= 1

    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert sorted(steps[0]["indices"]) == [0, 1, 2, 3] and sorted(steps[1]["indices"]) == [4, 5]
    assert {g.split(".")[0] for g in steps[0]["group_ids"]} == \
        {"g000000-r0", "g000001-r0", "g000002-r0", "g000003-r0"}
    # `undertow ui` names a step's groups from it (the launch order no longer says).
    groups, where = RunFolder("run", run_dir).step_groups(2)
    assert (sorted(groups), where) == (["g000004-r0", "g000005-r0"], "recorded")

    accumulator = EventAccumulator(str(run_dir / "trackers" / "tensorboard"))
    accumulator.Reload()
    for key in ("reward_mean", "num_dropped_uniform", "num_dropped_invalid",
                "num_rerun_sessions", "kl", "entropy", "num_trained_tokens"):
        got = [(e.step, e.value) for e in accumulator.Scalars(f"train/{key}")]
        assert got == [(r["step"], pytest.approx(r[key])) for r in records], key

    printed = log.read_text()
    assert "dropped group" not in printed   # counted in the step's line; told in the run's log
    logged = (run_dir / "train.log").read_text()
    assert "step 1: dropped group g000000-r0: every session trained would enter with " \
        "reward 1.0 (no signal)" in logged
    assert "step 1: dropped group g000001-r0: 1 valid session(s) left; Undertow failed " \
        "{'error:reward': 4}" in logged
    assert "undertow train: step 1/2 · reward 0.333 ± 0.471 · pass 33% · dropped uniform 1, " \
        "invalid 1, stale 0 · re-run 2 (failed: error:reward 4)" in printed
    assert "undertow train: step 2/2 · reward 0.333" in printed
    assert f"undertow train: reward curve {run_dir / 'plots' / 'reward.png'}" in printed


def test_pool_run_whose_every_grading_crashes_stops_with_one_line(tiny_model_dir, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    run_train([*_planned_run(tiny_model_dir, run_dir, "{default: dead}"),
               "learner.num_steps=1", "learner.max_failed_groups=3"], log, expected_code=1)

    printed = log.read_text()
    errors = [line for line in printed.splitlines() if line.startswith("undertow train: error")]
    assert errors == ["undertow train: error: the last 3 groups had no session the policy "
                      "could be trained on: every session failed with error:reward (a failure "
                      "of Undertow, not of the policy, after each slot's configured attempts); "
                      "last error: RewardError: task reward_crash: reward function "
                      f"{__name__}:reward_crash raised RuntimeError: the grader crashed. Fix "
                      "that cause and rerun."], printed[-3000:]
    assert "Traceback" not in printed and read_metrics(run_dir) == []
