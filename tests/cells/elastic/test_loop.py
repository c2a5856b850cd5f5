"""The run's loop (`undertow/cells/loop.py`) with `ElasticLearner` on a pool of cells: it streams
each step's groups into the open elastic step as they finish, and a stopped run resumes
from its checkpoint.

Real parts: the elastic policy, `CellRoles` with learner members as threads
(`ThreadMembers`), the elastic `Coordinator`, `ElasticLearner` with its checkpoints, on
the tiny model. Fakes at the edges only: a recording engine side (the gateway is outside
the learner) and a scripted group source. Each step has two groups of three sessions;
the first finishes at once, the second only after the open step has trained the first
(every micro-batch appended so far claimed and a member waiting for more), so a loop
that trained a step only once all its groups were in would never finish.

Three runs of two steps: one uninterrupted; one stopped while the second step's first
group is training (the open step is aborted, the finished group saved as pending); and
its resume, which trains the pending group again, launches only the group that was
still running (under a new group ID) and ends where the uninterrupted run ends.
"""

import json
import threading
import time

import pytest
import torch

from tests.cells.elastic.test_local import RecordingEngines
from tests.learner.random_trees import build_random_tree
from undertow.cells import Cell, make_policy
from undertow.cells.elastic.learner import ElasticLearner
from undertow.cells.elastic.local import CellRoles, ThreadMembers
from undertow.cells.loop import RunLoop, read_timeline
from undertow.cells.pool import CellPool
from undertow.learner.checkpoint import latest_checkpoint, load_checkpoint
from undertow.learner.config import AdvantageConfig, LossConfig, TrainConfig
from undertow.learner.metrics_log import read_metrics
from undertow.learner.train import FinishedGroup

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0
CONFIG = TrainConfig(num_steps=2, groups_per_step=2, group_size=3, max_staleness=0,
                     lr=1e-3, max_tokens=40)


class ScriptedSource:
    """Group i's tree is random, seeded by i. The first group of a step finishes at
    launch; the second once the open elastic step has trained all that was appended.
    With `interrupt_at`, that group never finishes: `stop` is set instead."""

    def __init__(self, coordinator, stop, interrupt_at=None):
        self.coordinator, self.stop, self.interrupt_at = coordinator, stop, interrupt_at
        self.launched, self.ready, self.held = [], [], []
        self.deadline = time.monotonic() + TIMEOUT_S

    def launch(self, request):
        self.launched.append(request)
        (self.held if request.index % 2 else self.ready).append(request)

    def wait(self, timeout_s):
        time.sleep(min(timeout_s, 0.02))
        if self.held and self._appended_groups_trained():
            if self.held[0].index == self.interrupt_at:
                self.stop.set()
            else:
                self.ready += self.held
                self.held = []
        assert time.monotonic() < self.deadline, "the step never trained its first group"
        ready, self.ready = self.ready, []
        return [FinishedGroup(r.index, _sampled_by(build_random_tree(r.index + 1, r.group_id),
                                                   r.weight_version)) for r in ready]

    def _appended_groups_trained(self):
        coordinator = self.coordinator
        return (coordinator.step_open and coordinator.num_micro_batches > 0
                and coordinator.num_claimed() > coordinator.num_micro_batches)


def _sampled_by(tree, weight_version):
    """The tree with its sampled tokens stamped with the launch's weight version, as the
    gateway records them."""
    for node in tree.nodes.values():
        if node.trainable:
            node.weight_versions = [weight_version] * len(node.token_ids)
    return tree


class IdleRollout:
    """The gateway's view: no live session counts (finished groups count in full)."""

    def num_sessions(self):
        return {}

    def num_closed(self, group_ids):
        return {}

    def prepare(self, cell_ids):
        return None


class Pushes:
    def __init__(self):
        self.versions = []

    def push(self, model_dir, weight_version):
        self.versions.append(weight_version)


def _run(tiny_model_dir, run_dir, resume=False, interrupt_at=None):
    """One pool run on three cells; returns (outcome, learner, source, pushes)."""
    learner = (ElasticLearner.restore if resume else ElasticLearner)(
        CONFIG, LossConfig(), AdvantageConfig(), tiny_model_dir, run_dir, {}, timeout_s=TIMEOUT_S)
    members = ThreadMembers(learner.coordinator.address, tiny_model_dir, timeout_s=TIMEOUT_S)
    stop = threading.Event()
    source = ScriptedSource(learner.coordinator, stop, interrupt_at)
    roles = CellRoles([Cell(i, num_session_slots=2) for i in range(3)],
                      RecordingEngines(range(3)), members, weight_version=learner.state.step)
    pushes = Pushes()
    pool = CellPool(roles, make_policy("elastic"), IdleRollout(), pushes)
    try:
        outcome = RunLoop(learner, pool, source, stop).run()
    finally:
        members.close()
        learner.close()
    return outcome, learner, source, pushes


def test_groups_stream_into_the_open_step_and_a_stopped_run_resumes(tiny_model_dir, tmp_path):
    outcome, _learner, _source, pushes = _run(tiny_model_dir, tmp_path / "whole")
    assert outcome == "done" and pushes.versions == [1, 2]
    events = read_timeline(tmp_path / "whole")
    added = [(e["step"], e["num_groups_left"]) for e in events if e["event"] == "GroupAdded"]
    assert added == [(0, 1), (0, 0), (1, 1), (1, 0)]

    run_dir = tmp_path / "stopped"
    outcome, _learner, source, pushes = _run(tiny_model_dir, run_dir, interrupt_at=3)
    assert outcome == "stopped" and pushes.versions == [1]
    assert [r.group_id for r in source.launched] == ["g000000-r0", "g000001-r0", "g000002-r0",
                                                     "g000003-r0"]
    checkpoint = load_checkpoint(latest_checkpoint(run_dir), restore_rng=False)
    assert checkpoint.state.step == 1 and checkpoint.state.num_launched == 4
    assert [group.index for group in checkpoint.pending] == [2]

    outcome, resumed, source, pushes = _run(tiny_model_dir, run_dir, resume=True)
    assert outcome == "done" and pushes.versions == [2]
    assert resumed.state.num_resumes == 1 and resumed.state.consumed == [0, 1, 2, 3]
    assert [(r.index, r.group_id, r.weight_version) for r in source.launched] == \
        [(3, "g000003-r1", 1)]
    restored = [e for e in read_timeline(run_dir) if e["event"] == "restored"]
    assert [(e["step"], e["finished"]) for e in restored] == [(1, [2])]
    # The resumed run's second step is the uninterrupted run's.
    expected, actual = read_metrics(tmp_path / "whole"), read_metrics(run_dir)
    assert [r["step"] for r in actual] == [1, 2]
    for name in ("loss", "grad_norm", "reward_mean"):
        assert actual[1][name] == pytest.approx(expected[1][name], rel=1e-4, abs=1e-6)
    assert actual[1]["num_trained_tokens"] == expected[1]["num_trained_tokens"]
    # The optimizer went on from its checkpoint (a fresh one would count one step).
    trainer = torch.load(latest_checkpoint(run_dir) / "trainer.pt", weights_only=True)
    assert {int(s["step"]) for s in trainer["optimizer"]["state"].values()} == {2}
    state = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())
    assert state["step"] == 2
