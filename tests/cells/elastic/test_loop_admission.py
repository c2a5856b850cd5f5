"""Which finished groups a pool run trains (`undertow/cells/loop.py` with `admission.py`):
the plain loop's rules, carried out inside the pool's steps.

Real parts: the elastic policy, `CellRoles` with learner members as threads
(`ThreadMembers`), the elastic `Coordinator` and `ElasticLearner` on the tiny model.
Fakes at the edges only: a recording engine side and the plain loop's planned group
source (each launch finishes at once with the group its plan gives).

- A uniform group is dropped (up to `max_extra_groups` per step, then trained as it
  is), a group with one valid session and one with nothing trainable are dropped, and
  each is replaced in its step by the next launch; every step's metrics line counts
  them like the plain loop's, reaches `on_step`, and its loss, KL and entropy are the
  plain learner's on the same groups. Which groups were dropped and why is written to
  the run's log (`RUN/train.log`), one line each, and not printed.
- Groups whose every session Undertow failed stop the run with one RunFailedError
  naming the cause after `max_failed_groups` in a row; the open elastic step is
  aborted, so the member in it returns instead of waiting.
- A run stopped after a replacement resumes with the launch indices still live: the
  finished one from the checkpoint, the running one launched again; the dropped one
  and the trained ones never again.
"""

import threading

import pytest

from tests.cells.elastic.test_local import RecordingEngines
from tests.cells.elastic.test_loop import IdleRollout
from tests.learner.test_train_admission import (
    NullSink,
    PlannedSource,
    _failed,
    _no_calls,
    _normal,
)
from undertow.cells import Cell, make_policy
from undertow.cells.elastic.learner import ElasticLearner
from undertow.cells.elastic.local import CellRoles, ThreadMembers
from undertow.cells.loop import RunLoop, read_timeline
from undertow.cells.pool import CellPool
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.errors import RunFailedError
from undertow.learner.metrics_log import read_metrics
from undertow.learner.train import Learner

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0
CONFIG = TrainConfig(num_steps=2, groups_per_step=2, group_size=3, max_staleness=0,
                     lr=1e-3, max_tokens=40, max_failed_groups=3)
UNIFORM = AdvantageConfig(filter_uniform_groups=True, max_extra_groups=1)


class HoldingSource(PlannedSource):
    """`PlannedSource` (launch i finishes at once with `plan(i, group_id)`) that keeps
    the requests and the groups it returned; launch `hold` never finishes, and `stop`
    is set by the first wait after it."""

    def __init__(self, plan, hold, stop):
        super().__init__(plan)
        self.hold, self.stop = hold, stop
        self.requests, self.returned = [], {}

    def launch(self, request):
        super().launch(request)
        self.requests.append(request)
        if request.index == self.hold:
            self.ready.pop()

    def wait(self, timeout_s):
        if self.hold in self.launches:
            self.stop.set()
        groups = super().wait(timeout_s)
        self.returned.update({group.index: group for group in groups})
        return groups


def _uniform(index, group_id):
    group = _normal(index, group_id)
    for session_id in group.tree.sessions:
        group.tree.close_session(session_id, 1.0)
    return group


def _pool_run(tiny_model_dir, run_dir, plan, advantages, hold=None, resume=False):
    """One pool run on three cells (with `hold`, stopped once that launch is made; with
    `resume`, continuing the latest checkpoint); returns (outcome or the error,
    learner, source, the records `on_step` got, the member threads)."""
    learner = (ElasticLearner.restore if resume else ElasticLearner)(
        CONFIG, LossConfig(), advantages, tiny_model_dir, run_dir, {}, timeout_s=TIMEOUT_S)
    members = ThreadMembers(learner.coordinator.address, tiny_model_dir, timeout_s=TIMEOUT_S)
    stop, records, threads = threading.Event(), [], []
    source = HoldingSource(plan, hold, stop)
    roles = CellRoles([Cell(i, num_session_slots=2) for i in range(3)],
                      RecordingEngines(range(3)), members, weight_version=learner.state.step)
    pool = CellPool(roles, make_policy("elastic"), IdleRollout(), NullSink())
    loop = RunLoop(learner, pool, source, stop, on_step=records.append)
    try:
        outcome = loop.run()
    except RunFailedError as error:
        outcome = error
    finally:
        threads = [thread for thread, _inbox in members.running.values()]
        members.close()
        learner.close()
    return outcome, learner, source, records, threads


def _dropped(run_dir):
    return [(e["step"], e["index"], e["reason"], e["replacement"])
            for e in read_timeline(run_dir) if e["event"] == "GroupDropped"]


def test_dropped_groups_are_replaced_in_their_step_and_counted(tiny_model_dir, tmp_path,
                                                               capsys):
    plan = {0: _uniform, 2: lambda i, g: _failed(i, g, num_valid=1), 3: _no_calls,
            5: _uniform, 7: _uniform}
    run_dir = tmp_path / "pool"
    outcome, learner, source, records, _threads = _pool_run(
        tiny_model_dir, run_dir, lambda i, g: plan.get(i, _normal)(i, g), UNIFORM)

    assert outcome == "done" and source.launches == list(range(8))
    assert _dropped(run_dir) == [(0, 0, "uniform", 2), (0, 2, "invalid", 3),
                                 (0, 3, "empty", 4), (1, 5, "uniform", 7)]
    assert learner.state.consumed == [0, 2, 3, 1, 4, 5, 6, 7]
    first, second = read_metrics(run_dir)
    assert records == [first, second]
    assert (first["num_dropped_uniform"], first["num_dropped_invalid"]) == (1, 2)
    assert first["infra_failures"] == {"error:sandbox": 2} and first["num_infra_failures"] == 2
    assert first["num_sessions"] == 6 and first["num_groups"] == 2
    # Past the bound of one extra group, step 2's second uniform group trains as it is.
    assert (second["num_dropped_uniform"], second["num_dropped_invalid"]) == (1, 0)
    assert second["reward_mean"] == pytest.approx(4 / 6)
    # Which groups were dropped, and why, is in the run's log, one line each; nothing of
    # it is printed (the step's line, printed by `on_step`'s owner, counts them).
    assert "dropped" not in capsys.readouterr().out
    logged = [line.split(" ", 1)[1] for line in (run_dir / "train.log").read_text().splitlines()]
    assert [line.split(":")[0] for line in logged] == ["step 1"] * 3 + ["step 2"]
    assert logged[0].startswith("step 1: dropped group g000000-r0: every session trained "
                                "would enter with reward 1.0 (no signal)")
    assert logged[1].startswith("step 1: dropped group g000002-r0: 1 valid session(s) left")
    assert logged[2] == ("step 1: dropped group g000003-r0: not trained: no trainable token "
                         "in its sessions")
    assert logged[3].startswith("step 2: dropped group g000005-r0: every session trained")

    # The first step's record is the plain learner's on the same two groups.
    plain = Learner(CONFIG, LossConfig(), UNIFORM, tiny_model_dir, tmp_path / "plain")
    expected = plain.train_step([source.returned[i].tree for i in (1, 4)])
    for name in ("loss", "grad_norm", "kl", "entropy", "reward_mean", "num_trained_tokens"):
        assert first[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    assert first["entropy"] > 0


def test_groups_whose_every_session_failed_stop_the_pool_run(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "pool"
    error, learner, source, records, threads = _pool_run(
        tiny_model_dir, run_dir, lambda i, g: _normal(i, g) if i == 0 else _failed(i, g),
        AdvantageConfig())

    assert isinstance(error, RunFailedError)
    assert "the last 3 groups had no session the policy could be trained on: every " \
        "session failed with error:sandbox" in str(error)
    assert "last error: SandboxError: the daemon refused the container" in str(error)
    assert source.launches == [0, 1, 2, 3] and records == [] and read_metrics(run_dir) == []
    events = [e["event"] for e in read_timeline(run_dir)]
    assert "StepOpened" in events   # group 0 was training when the run stopped
    assert not learner.coordinator.step_open
    assert threads and not any(thread.is_alive() for thread in threads)


def test_a_run_stopped_after_a_replacement_resumes_with_its_live_launches(tiny_model_dir,
                                                                          tmp_path):
    run_dir = tmp_path / "pool"
    plan = {0: _uniform}
    outcome, _learner, source, _records, _threads = _pool_run(
        tiny_model_dir, run_dir, lambda i, g: plan.get(i, _normal)(i, g), UNIFORM, hold=4)
    assert outcome == "stopped" and source.launches == [0, 1, 2, 3, 4]
    assert _dropped(run_dir) == [(0, 0, "uniform", 2)]

    outcome, resumed, source, records, _threads = _pool_run(
        tiny_model_dir, run_dir, _normal, UNIFORM, resume=True)
    assert outcome == "done" and resumed.state.num_resumes == 1
    assert [(r.index, r.group_id) for r in source.requests] == [(4, "g000004-r1")]
    restored = [e for e in read_timeline(run_dir) if e["event"] == "restored"]
    assert [(e["step"], e["finished"]) for e in restored] == [(1, [3])]
    assert sorted(resumed.state.consumed) == [0, 1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2] and len(records) == 1
