"""The local pool carries out the elastic policy's decisions on a hand-made trace.

Three CPU cells with two session slots each roll out one step of two groups of three
sessions. As sessions finish, the policy moves cell 2 to training and opens the step;
the first group, complete, streams into it while the second still runs; the policy
then moves cell 1. The pool drains their engines (a recording engine side: the gateway
is outside the learner) and sends their real learner members (threads,
`ThreadMembers`) into the open elastic step, cell 1 joining mid-step before the second
group arrives. The step's gradient equals the single-process one over both groups;
after the step is published both cells serve the new weights and the next batch is
dispatched.

A sharded cell (`ProcessMembers` with `processes_per_cell=2`): the pool moves a cell to
training, which starts its two processes as one FSDP2 mesh over gloo (the tiny model
with an LM head of its own, so every unit is sharded); the step streams in group by
group; its gradient equals one process's `backward_step` within 1e-5 of each
parameter's scale (AdamW's first step is not compared: it divides each gradient by its
own magnitude, so elements near zero amplify float-order differences); the cell is one
member on the roster and claims every micro-batch; moving it back to rollout ends both
processes cleanly.
"""

import time

import pytest
import torch

from tests.learner.test_losses import _advantages, _assert_gradients_close, _gradients
from undertow.cells import (
    BatchProgress,
    Cell,
    CellPoolError,
    DispatchBatch,
    IllegalTransition,
    MoveToRollout,
    MoveToTraining,
    Role,
    StartTraining,
    make_policy,
)
from undertow.cells.elastic.local import CellRoles, ProcessMembers, ThreadMembers, member_name
from undertow.cells.elastic.step import Coordinator
from undertow.learner.config import LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step

TIMEOUT_S = 120.0


class RecordingEngines:
    """The rollout side of the cells: serves or drains, and refuses a double drain."""

    def __init__(self, cell_ids):
        self.serving = set(cell_ids)
        self.log: list[tuple] = []

    def drain(self, cell_id):
        if cell_id not in self.serving:
            raise AssertionError(f"cell {cell_id} drained while not serving")
        self.serving.remove(cell_id)
        self.log.append(("drain", cell_id))

    def serve(self, cell_id, weight_version):
        self.serving.add(cell_id)
        self.log.append(("serve", cell_id, weight_version))


def _until(predicate, what):
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


@pytest.fixture
def pool_parts(tiny_model_dir, tmp_path):
    policy = PolicyModel.load(tiny_model_dir, dtype=torch.float32)
    coordinator = Coordinator(policy, tmp_path, timeout_s=TIMEOUT_S)
    members = ThreadMembers(coordinator.address, tiny_model_dir, timeout_s=TIMEOUT_S)
    engines = RecordingEngines(range(3))
    pool = CellRoles([Cell(i, Role.ROLLOUT, 2) for i in range(3)], engines, members)
    try:
        yield pool, coordinator, engines
    finally:
        members.close()
        coordinator.close()


@pytest.mark.slow
def test_elastic_trace_moves_cells_into_a_running_step(pool_parts, random_trees):
    pool, coordinator, engines = pool_parts
    policy, config = make_policy("elastic"), LossConfig()
    packed = pack_step(random_trees, _advantages(random_trees), 40)
    chunks = [pack_step([tree], _advantages([tree]), 40) for tree in random_trees]
    coordinator.policy.model.zero_grad(set_to_none=True)
    expected_stats = backward_step(coordinator.policy, packed, config)
    expected = _gradients(coordinator.policy)

    pool.update_sessions({0: 2, 1: 2, 2: 2})
    batch = BatchProgress(0, num_sessions=6, num_dispatched=6, num_finished=0)
    assert policy.decide(pool.snapshot((batch,), num_steps=2)) == []

    # Two sessions finished, both on cell 2: 4 outstanding fit in cells 0 and 1.
    pool.update_sessions({2: 0})
    batch = BatchProgress(0, 6, 6, num_finished=2)
    decisions = policy.decide(pool.snapshot((batch,), num_steps=2))
    assert decisions == [MoveToTraining(2), StartTraining(0)]
    pool.carry_out(decisions)
    assert engines.log == [("drain", 2)] and pool.cells[2].role is Role.TRAINING
    coordinator.open_step(0, config)
    _until(lambda: coordinator.num_claimed() >= 1, "cell 2 holds the first ticket")
    coordinator.append(chunks[0])    # the first group is complete; the second runs on
    num_first = len(chunks[0].micro_batches)
    _until(lambda: coordinator.num_claimed() >= num_first + 1, "cell 2 trained group 1")

    pool.update_sessions({0: 1, 1: 1})
    batch = BatchProgress(0, 6, 6, num_finished=4, training_started=True)
    decisions = policy.decide(pool.snapshot((batch,), num_steps=2))
    assert decisions == [MoveToTraining(1)]
    pool.carry_out(decisions)
    _until(lambda: coordinator.num_claimed() >= num_first + 2,
           "cell 1 joined and holds a ticket")
    assert coordinator.members() == [member_name(2), member_name(1)]

    coordinator.append(chunks[1])
    result = coordinator.finish_step()
    _assert_gradients_close(_gradients(coordinator.policy), expected)
    assert result.stats["loss"] == pytest.approx(expected_stats["loss"], rel=1e-5)
    assert set(result.claims[member_name(2)]) >= set(range(num_first))
    assert result.claims[member_name(1)]
    pool.step_published(0)

    decisions = policy.decide(pool.snapshot((), num_steps=2))
    assert decisions == [MoveToRollout(1), MoveToRollout(2), DispatchBatch(1)]
    pool.carry_out(decisions[:2])   # the loop carries out DispatchBatch
    assert engines.log[1:] == [("drain", 1), ("serve", 1, 1), ("serve", 2, 1)]
    assert all(cell.role is Role.ROLLOUT for cell in pool.cells.values())
    assert pool.weight_version == 1 and pool.open_step is None


def test_the_pool_refuses_what_the_table_forbids(pool_parts):
    pool, _coordinator, engines = pool_parts
    with pytest.raises(CellPoolError, match="not a role decision"):
        pool.carry_out([DispatchBatch(0)])
    with pytest.raises(IllegalTransition, match="must head to training"):
        pool.carry_out([MoveToRollout(0)])
    with pytest.raises(CellPoolError, match="not the open step"):
        pool.step_published(0)
    pool.carry_out([StartTraining(0)])
    with pytest.raises(CellPoolError, match="still open"):
        pool.carry_out([StartTraining(1)])
    with pytest.raises(CellPoolError, match="starts in training"):
        CellRoles([Cell(0, Role.TRAINING)], engines, pool.members)
    assert engines.log == [] and pool.cells[0].role is Role.ROLLOUT


@pytest.mark.slow
def test_a_sharded_cell_trains_the_pool_step_one_process_trains(tiny_untied_model_dir,
                                                               random_trees):
    policy = PolicyModel.load(tiny_untied_model_dir, dtype=torch.float32)
    config = LossConfig()
    packed = pack_step(random_trees, _advantages(random_trees), 36)
    chunks = [pack_step([tree], _advantages([tree]), 36) for tree in random_trees]
    num_micro_batches = sum(len(chunk.micro_batches) for chunk in chunks)
    assert num_micro_batches % 2 == 1   # one process runs an idle round
    policy.model.zero_grad(set_to_none=True)
    expected_stats = backward_step(policy, packed, config)
    expected = _gradients(policy)

    coordinator = Coordinator(policy, timeout_s=TIMEOUT_S)
    members = ProcessMembers(coordinator.address, tiny_untied_model_dir, timeout_s=TIMEOUT_S,
                             processes_per_cell=2)
    engines = RecordingEngines(range(2))
    pool = CellRoles([Cell(i, Role.ROLLOUT, 2) for i in range(2)], engines, members)
    try:
        pool.carry_out([MoveToTraining(1), StartTraining(0)])
        assert len(members.running[1].processes) == 2
        digest = coordinator.open_step(0, config)
        for chunk in chunks:
            coordinator.append(chunk)
        result = coordinator.finish_step()
        got = _gradients(coordinator.policy)
        pool.step_published(0)
        pool.carry_out([MoveToRollout(1)])   # waits for both processes to exit cleanly
    finally:
        members.close()
        coordinator.close()
    _assert_gradients_close(got, expected)
    assert "lm_head.weight" in got
    assert result.stats["loss"] == pytest.approx(expected_stats["loss"], rel=1e-5)
    assert result.ranks == ["coordinator", member_name(1)]
    assert result.weights_digests[member_name(1)] == digest   # its gathered shards, head too
    assert sorted(result.claims[member_name(1)]) == list(range(num_micro_batches))
    assert engines.log == [("drain", 1), ("serve", 1, 1)] and not members.running


def test_a_sharded_cell_refuses_a_kl_reference(tiny_model_dir):
    with pytest.raises(CellPoolError, match="kl_coef"):
        ProcessMembers(("127.0.0.1", 1), tiny_model_dir, processes_per_cell=2,
                       reference_dir=str(tiny_model_dir))
    with pytest.raises(CellPoolError, match="processes_per_cell"):
        ProcessMembers(("127.0.0.1", 1), tiny_model_dir, processes_per_cell=0)
