"""The simulator: invariants of its runs, workloads, and `undertow simulate`."""

import dataclasses
import math

import numpy as np
import pytest

from undertow.cells import IllegalTransition, MoveToTraining
from undertow.cells.policy import make_policy
from undertow.cells.sim import (
    SimulationError,
    Simulator,
    load_workload,
    simulate,
    workload_from_dict,
)
from undertow.cells.sim.workload import LongTail
from undertow.cli import main


def small_workload(time_limit_s=600.0, **engine):
    """Long-tailed but small: 4 tasks x 4 sessions, on cells of 4 slots."""
    return workload_from_dict({
        "name": "small",
        "batch": {"num_tasks_per_step": 4, "group_size": 4},
        "session": {
            "num_turns": {"median": 4, "p99": 40, "minimum": 1, "integer": True},
            "completion_tokens": {"median": 50, "p99": 500, "minimum": 1, "integer": True},
            "observation_tokens": {"median": 80, "p99": 800, "integer": True},
            "tool_latency_s": {"median": 2, "p99": 20},
            "prompt_tokens": 200, "time_limit_s": time_limit_s},
        "engine": {"num_session_slots": 4, "decode_base_s": 0.05,
                   "decode_per_sequence_s": 0.002, "decode_per_kilotoken_s": 0.001,
                   "prefill_chunk_tokens": 256, **engine},
        "trainer": {"tokens_per_s_per_cell": 200, "optimizer_step_s": 5, "weight_sync_s": 3},
    })


ASYNC_ELASTIC = {"name": "elastic", "max_staleness": 1}
POLICIES = ["colocate", {"name": "split", "num_training_cells": 1},
            {"name": "split", "num_training_cells": 2}, "elastic", ASYNC_ELASTIC]


def run(policy, workload=None, num_cells=4, num_steps=3, seed=0):
    sim = Simulator(workload or small_workload(), make_policy(policy), num_cells, num_steps, seed)
    return sim, sim.run()


@pytest.mark.parametrize("policy", POLICIES)
def test_every_dispatched_session_finishes_or_times_out(policy):
    workload = small_workload(time_limit_s=120.0)
    sim, result = run(policy, workload)
    assert len(sim.sessions) == 3 * workload.num_sessions_per_step
    for session in sim.sessions.values():
        assert session.done and not session.generating
        if session.timed_out:
            assert session.finished_s - session.started_s == pytest.approx(120.0)
            assert session.turn_index < len(session.plan.turns)
        else:
            assert session.turn_index == len(session.plan.turns)
            assert session.finished_s - session.started_s <= 120.0
    assert result.num_timed_out == sum(s.timed_out for s in sim.sessions.values()) > 0


def test_samples_per_step_are_equal_across_policies():
    results = [run(policy)[1] for policy in POLICIES]
    for result in results:
        assert [s.num_sessions for s in result.steps] == [16, 16, 16]
        assert [s.step for s in result.steps] == [0, 1, 2]


def test_a_run_is_deterministic_for_a_seed():
    first = run("elastic", seed=3)[1].to_dict(with_timeline=True)
    assert run("elastic", seed=3)[1].to_dict(with_timeline=True) == first
    assert run("elastic", seed=4)[1].to_dict() != run("elastic", seed=3)[1].to_dict()


@pytest.mark.parametrize("policy", POLICIES)
def test_utilisation_is_a_fraction_and_cell_time_adds_up(policy):
    _, result = run(policy)
    for role, value in result.utilisation.items():
        assert 0.0 <= value <= 1.0 + 1e-9, role
    assert sum(result.cell_s.values()) == pytest.approx(result.num_cells * result.makespan_s)
    for span in result.timeline:
        assert 0 <= span.start_s < span.end_s <= result.makespan_s


def test_staleness_follows_the_policy():
    assert run("colocate")[1].mean_staleness == 0
    assert run("elastic")[1].mean_staleness == 0
    assert [s.staleness for s in run({"name": "split", "num_training_cells": 1})[1].steps] \
        == [0, 1, 1]
    synchronous = {"name": "split", "num_training_cells": 1, "max_staleness": 0}
    assert run(synchronous)[1].mean_staleness == 0
    assert [s.staleness for s in run(ASYNC_ELASTIC)[1].steps] == [0, 1, 1]


def test_async_elastic_starts_the_next_step_before_the_current_one_is_published():
    sim, result = run(ASYNC_ELASTIC)
    steps = result.steps
    assert all(steps[k + 1].dispatched_s < steps[k].published_s for k in range(2))
    # Step 2 waits for step 0's weights (staleness 1), never for step 1's.
    assert steps[2].dispatched_s == pytest.approx(steps[0].published_s)
    started = {step: min(s.started_s for s in sim.sessions.values() if s.plan.step == step)
               for step in (1, 2)}
    assert started[1] < steps[0].rollout_done_s and started[2] < steps[1].rollout_done_s


@pytest.mark.parametrize("policy", POLICIES)
def test_no_run_beats_its_work_floor(policy):
    _, result = run(policy)
    assert 0 < result.work_floor_per_step_s <= result.time_per_step_s


def test_elastic_moves_cells_while_the_tail_runs_and_returns_them():
    _, result = run("elastic", num_steps=2)
    first = result.steps[0]
    training_starts = [s.start_s for s in result.timeline if s.role.value == "training"]
    assert min(training_starts) < first.rollout_done_s
    # After the last step every cell is back in rollout or on its way (no cell left training
    # across a step boundary while the next batch has not opened training).
    colocate = run("colocate", num_steps=2)[1]
    assert all(s.start_s >= colocate.steps[0].rollout_done_s
               for s in colocate.timeline if s.role.value == "training")


def test_training_cost_changes_the_run():
    cheap = small_workload()
    costly = dataclasses.replace(cheap, trainer=dataclasses.replace(cheap.trainer,
                                                                   tokens_per_s_per_cell=20))
    assert run("colocate", costly)[1].makespan_s > run("colocate", cheap)[1].makespan_s


def test_a_stalling_policy_is_reported():
    class Idle:
        name = "idle"

        def decide(self, state):
            return []

    with pytest.raises(SimulationError, match="stalled"):
        Simulator(small_workload(), Idle(), 2, 1).run()


def test_an_illegal_decision_raises_the_pools_error():
    class Twice:
        name = "twice"

        def decide(self, state):
            return [MoveToTraining(0)]

    with pytest.raises(IllegalTransition):
        Simulator(small_workload(), Twice(), 2, 1).run()


def test_long_tail_has_its_p99_at_the_given_multiple_of_the_median():
    values = LongTail(median=20, p99=200).sample(np.random.default_rng(0), 200_000)
    assert np.percentile(values, 50) == pytest.approx(20, rel=0.03)
    assert np.percentile(values, 99) == pytest.approx(200, rel=0.05)
    capped = LongTail(median=20, p99=200, maximum=100).sample(np.random.default_rng(0), 1000)
    assert capped.max() == 100


def test_sessions_do_not_depend_on_the_policy_or_on_order():
    workload = load_workload("qwengyre_long_tail")
    assert workload.sample_batch(7, 2) == workload.sample_batch(7, 2)
    assert workload.sample_batch(7, 2) != workload.sample_batch(7, 3)


@pytest.mark.parametrize("name", ["qwengyre_long_tail", "short_tail"])
def test_presets_load_with_qwengyres_switch_costs(name):
    workload = load_workload(name)
    assert (workload.trainer.switch_to_training_s, workload.trainer.switch_to_rollout_s) \
        == (8.52, 3.46)
    assert math.isfinite(workload.session.time_limit_s)


def test_bad_workloads_say_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="missing"):
        workload_from_dict({"batch": {}})
    with pytest.raises(ValueError, match="median"):
        LongTail(median=5, p99=1)
    with pytest.raises(FileNotFoundError, match="presets"):
        load_workload(tmp_path / "absent.yaml")


def test_simulate_accepts_a_json_workload(tmp_path):
    import json

    data = {"name": "j", "batch": {"num_tasks_per_step": 1, "group_size": 2},
            "session": {"num_turns": {"median": 2, "p99": 4, "integer": True, "minimum": 1},
                        "completion_tokens": {"median": 10, "p99": 20, "integer": True},
                        "observation_tokens": {"median": 10, "p99": 20, "integer": True},
                        "tool_latency_s": {"median": 1, "p99": 2},
                        "prompt_tokens": 10, "time_limit_s": 100},
            "engine": {"num_session_slots": 2, "decode_base_s": 0.01,
                       "decode_per_sequence_s": 0, "decode_per_kilotoken_s": 0,
                       "prefill_chunk_tokens": 64},
            "trainer": {"tokens_per_s_per_cell": 100, "optimizer_step_s": 1, "weight_sync_s": 1}}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    result = simulate(load_workload(path), "elastic", num_cells=2, num_steps=2)
    assert [s.num_sessions for s in result.steps] == [2, 2]


@pytest.mark.parametrize("name", ["qwengyre_long_tail", "short_tail"])
def test_undertow_simulate_prints_a_table_and_writes_a_png(name, tmp_path, capsys):
    out = tmp_path / "roles.png"
    code = main(["simulate", "--workload", name, "--policy", "elastic", "--cells", "8",
                 "--steps", "1", "--seed", "1", "--max-staleness", "1", "--plot", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| time/step (s) |" in printed
    assert f"| {name} | elastic(staleness 1) | 8 | 1 |" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_undertow_simulate_defaults_to_the_policy_staleness_of_undertow_train(capsys):
    assert main(["simulate", "--workload", "short_tail", "--policy", "elastic",
                 "--cells", "4", "--steps", "1"]) == 0
    assert "| short_tail | elastic | 4 | 1 |" in capsys.readouterr().out


def test_undertow_simulate_rejects_an_unknown_policy(capsys):
    assert main(["simulate", "--workload", "short_tail", "--policy", "bogus",
                 "--cells", "2"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_sessions_streamed_one_by_one_reach_the_learner_earlier():
    grouped = small_workload()
    per_session = dataclasses.replace(grouped, trainer=dataclasses.replace(
        grouped.trainer, train_unit="session"))
    _, result_g = run("elastic", grouped, num_steps=1)
    _, result_s = run("elastic", per_session, num_steps=1)
    # The same sessions and the same tokens, trained no later.
    assert result_s.steps[0].num_unique_tokens == result_g.steps[0].num_unique_tokens
    assert result_s.makespan_s <= result_g.makespan_s
    with pytest.raises(ValueError, match="train_unit"):
        dataclasses.replace(grouped.trainer, train_unit="token")
