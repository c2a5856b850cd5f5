"""A sharded cell of two processes as one member of an elastic step (`cell.py`).

The coordinator (this process) moves its weights, opens a step and appends a group
while the cell (two spawned processes, FSDP2 over a gloo mesh, one leader on the
coordinator's store) trains in rounds; once the cell has drawn a ticket, a one-process
member (`elastic.Member`, as the local pool runs it) joins, so the membership changes
mid-step; three more groups arrive; the step finishes. The coordinator's gradient
equals the one-process reference (`backward_step` on the whole step) within 1e-5 of
each parameter's scale, every micro-batch was claimed exactly once by one of the two
members, the cell claimed some, and both trained with the coordinator's current weights
(the cell's digest is of its gathered shards).
"""

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.cells.elastic.test_step import _chunks, _whole_step
from tests.learner.random_trees import build_random_tree
from tests.learner.test_losses import _assert_gradients_close, _gradients
from undertow.cells.elastic.local import ProcessMembers, member_name
from undertow.cells.elastic.step import Coordinator, weights_digest
from undertow.learner.config import LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step

pytestmark = pytest.mark.slow

TIMEOUT_S = 300.0
CELL_SIZE = 2
CONFIG = LossConfig(name="grpo", correction="decoupled_ppo", max_importance_weight=1.5)


def _cell_process(rank: int, cell_port: int, address, model_dir: str, step: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from undertow.cells.elastic.sharded_cell import CellMember

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", cell_port, is_master=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=CELL_SIZE)
    try:
        member = CellMember(address if rank == 0 else None, "cell-a", model_dir,
                            init_device_mesh("cpu", (CELL_SIZE,)), timeout_s=TIMEOUT_S)
        assert member.join(step)
    finally:
        dist.destroy_process_group()


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def test_a_two_process_cell_trains_a_streamed_step_exactly(tiny_model_dir):
    trees = [build_random_tree(seed, f"g{seed}", num_turns=3 + seed % 3)
             for seed in range(1, 5)]
    policy = PolicyModel.load(tiny_model_dir)
    policy.model.train()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for parameter in policy.model.parameters():
            parameter.add_(1e-3 * torch.randn(parameter.shape, generator=generator))
    policy.model.zero_grad(set_to_none=True)
    backward_step(policy, _whole_step(trees, CONFIG), CONFIG)
    expected = _gradients(policy)

    coordinator = Coordinator(policy, timeout_s=TIMEOUT_S)
    cell_store = dist.TCPStore("127.0.0.1", 0, world_size=CELL_SIZE + 1, is_master=True,
                               wait_for_workers=False)
    members = ProcessMembers(coordinator.address, tiny_model_dir, timeout_s=TIMEOUT_S)
    context = mp.get_context("spawn")
    processes = [context.Process(target=_cell_process,
                                 args=(rank, cell_store.port, coordinator.address,
                                       str(tiny_model_dir), 0))
                 for rank in range(CELL_SIZE)]
    try:
        digest = coordinator.open_step(0, CONFIG)
        assert digest == weights_digest(policy.model)
        for process in processes:
            process.start()
        chunks = _chunks(trees, CONFIG)
        coordinator.append(chunks[0])
        _wait_until(lambda: coordinator.num_claimed() >= 1, "the cell draws a ticket")
        members.start(0)
        members.join(0, 0)
        _wait_until(lambda: member_name(0) in coordinator.members(), "the member joins")
        for chunk in chunks[1:]:
            coordinator.append(chunk)
        result = coordinator.finish_step()
        for process in processes:
            process.join(timeout=TIMEOUT_S)
            assert process.exitcode == 0
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        members.close()
        coordinator.close()
    _assert_gradients_close(_gradients(policy), expected)
    single = member_name(0)
    assert sorted(result.ranks) == sorted(["coordinator", "cell-a", single])
    claimed = result.claims["cell-a"] + result.claims[single]
    assert sorted(claimed) == list(range(result.num_micro_batches))
    assert result.claims["cell-a"]
    assert result.weights_digests["cell-a"] == result.weights_digests[single] == digest
