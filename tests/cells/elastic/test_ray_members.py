"""The Ray backend runs the local pool's elastic trace and gets the same outcome.

The trace is the one of `test_local.py`: three cells with two session slots each
roll out six sessions; the elastic policy moves cell 2 into a step that it opens, then
cell 1 into the running step (joining mid-step), and both back to rollout once the
weights are published. It runs twice in one test, with the members as threads
(`ThreadMembers`) and as Ray actors (`RayMembers`, one actor group per cell) on a local
Ray instance that declares three fake GPUs and one custom resource per cell; the
decisions, the cells' role changes, the engine and member calls and the step's
gradient must agree. Ray's processes must all be gone after `ray.shutdown()`.
"""

import importlib.util
import os
import time
from dataclasses import dataclass, field

import pytest
import torch

from tests.cells.elastic.test_local import TIMEOUT_S, RecordingEngines, _until
from tests.learner.test_losses import _advantages, _assert_gradients_close, _gradients
from tests.processes import alive, descendants
from undertow.cells import BatchProgress, Cell, CellPoolError, DispatchBatch, Role, make_policy
from undertow.cells.elastic.local import CellRoles, ThreadMembers, member_name
from undertow.cells.elastic.step import Coordinator
from undertow.learner.config import LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step

# Imported by the fixture, not here: Ray decides at import time whether to bind to loopback.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="ray is not installed (pip install -e '.[cluster]')"),
]

NUM_CELLS = 3


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray with 2 CPUs, 3 declared (fake) GPUs and a resource per cell; at
    teardown, every process it started must have exited."""
    from undertow.cells.elastic.ray_members import cell_resource, local_cluster

    resources = {cell_resource(i): 1 for i in range(NUM_CELLS)}
    before = descendants(os.getpid())
    with local_cluster(tmp_path_factory.mktemp("ray"), num_cpus=2, num_gpus=NUM_CELLS,
                       resources=resources) as node:
        started = descendants(os.getpid()) - before
        yield node
        started |= descendants(os.getpid()) - before
    deadline = time.monotonic() + TIMEOUT_S
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started, "the fixture saw no Ray process start; the check below would be vacuous"
    assert not alive(started), f"Ray processes left after ray.shutdown(): {alive(started)}"


class RecordingMembers:
    """Passes the pool's calls on to real members and writes them down."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def start(self, cell_id):
        self.log.append(("start", cell_id))
        self.inner.start(cell_id)

    def join(self, cell_id, step):
        self.log.append(("join", cell_id, step))
        self.inner.join(cell_id, step)

    def stop(self, cell_id):
        self.log.append(("stop", cell_id))
        self.inner.stop(cell_id)


@dataclass
class TraceRecord:
    decisions: list = field(default_factory=list)
    roles: list = field(default_factory=list)
    roster: list = field(default_factory=list)
    engine_log: list = field(default_factory=list)
    member_log: list = field(default_factory=list)
    dispatched: list = field(default_factory=list)
    claims: dict = field(default_factory=dict)
    loss: float = 0.0
    gradients: dict = field(default_factory=dict)
    placements: dict = field(default_factory=dict)


def run_trace(policy_model, coordinator, members, chunks, config,
              while_both_train=lambda: None) -> TraceRecord:
    """The trace of `test_local.py`, recorded instead of asserted; calls
    `while_both_train` while cells 1 and 2 are both in the step."""
    record, policy = TraceRecord(), make_policy("elastic")
    engines, recording = RecordingEngines(range(NUM_CELLS)), RecordingMembers(members)
    pool = CellRoles([Cell(i, Role.ROLLOUT, 2) for i in range(NUM_CELLS)], engines, recording)

    def decide_and_carry_out(batches):
        decisions = policy.decide(pool.snapshot(batches, num_steps=2))
        pool.carry_out([d for d in decisions if not isinstance(d, DispatchBatch)])
        record.dispatched.extend(d.step for d in decisions if isinstance(d, DispatchBatch))
        record.decisions.append(decisions)
        record.roles.append({i: cell.role for i, cell in pool.cells.items()})

    pool.update_sessions({0: 2, 1: 2, 2: 2})
    decide_and_carry_out((BatchProgress(0, 6, 6, num_finished=0),))
    pool.update_sessions({2: 0})
    decide_and_carry_out((BatchProgress(0, 6, 6, num_finished=2),))
    coordinator.open_step(0, config)
    _until(lambda: coordinator.num_claimed() >= 1, "cell 2 holds the first ticket")
    coordinator.append(chunks[0])    # the first group is complete; the second runs on
    num_first = len(chunks[0].micro_batches)
    _until(lambda: coordinator.num_claimed() >= num_first + 1, "cell 2 trained group 1")
    pool.update_sessions({0: 1, 1: 1})
    decide_and_carry_out((BatchProgress(0, 6, 6, num_finished=4, training_started=True),))
    _until(lambda: coordinator.num_claimed() >= num_first + 2,
           "cell 1 joined and holds a ticket")
    record.roster = coordinator.members()
    while_both_train()
    coordinator.append(chunks[1])
    result = coordinator.finish_step()
    record.gradients, record.loss = _gradients(policy_model), result.stats["loss"]
    record.claims = {name: len(claimed) for name, claimed in result.claims.items()}
    pool.step_published(0)
    decide_and_carry_out(())
    record.engine_log, record.member_log = engines.log, recording.log
    return record


@pytest.fixture
def step(tiny_model_dir, random_trees):
    """The policy, the step's groups each packed alone (as they stream in), and the
    single-process gradient and loss of the whole step."""
    policy_model = PolicyModel.load(tiny_model_dir, dtype=torch.float32)
    config = LossConfig()
    packed = pack_step(random_trees, _advantages(random_trees), 40)
    policy_model.model.zero_grad(set_to_none=True)
    stats = backward_step(policy_model, packed, config)
    chunks = [pack_step([tree], _advantages([tree]), 40) for tree in random_trees]
    return policy_model, chunks, config, _gradients(policy_model), stats["loss"]


def _run(backend, step, tiny_model_dir, work_dir):
    import ray

    from undertow.cells.elastic.ray_members import RayCell, RayMembers, cell_resource

    policy_model, chunks, config, _expected, _loss = step
    coordinator = Coordinator(policy_model, work_dir, timeout_s=TIMEOUT_S)
    placements = {}
    if backend == "ray":
        cells = {i: RayCell(num_gpus_per_member=1, resources_per_member={cell_resource(i): 1})
                 for i in range(NUM_CELLS)}
        members = RayMembers(coordinator.address, tiny_model_dir, cells, timeout_s=TIMEOUT_S)

        def while_both_train():
            placements.update({i: members.placements(i) for i in (1, 2)})
            _until(lambda: ray.available_resources().get("GPU", 0) == 1, "two GPUs are held")
            placements["free"] = dict(ray.available_resources())
    else:
        members = ThreadMembers(coordinator.address, tiny_model_dir, timeout_s=TIMEOUT_S)
        while_both_train = lambda: None  # noqa: E731
    try:
        record = run_trace(policy_model, coordinator, members, chunks, config, while_both_train)
    finally:
        members.close()
        coordinator.close()
    record.placements = placements
    return record


def test_the_ray_backend_runs_the_same_trace_as_the_local_one(
        ray_cluster, step, tiny_model_dir, tmp_path):
    import ray

    from undertow.cells.elastic.ray_members import cell_resource

    _policy, chunks, _config, expected, expected_loss = step
    local = _run("local", step, tiny_model_dir, tmp_path / "local")
    on_ray = _run("ray", step, tiny_model_dir, tmp_path / "ray")

    assert on_ray.decisions == local.decisions
    assert on_ray.roles == local.roles
    assert on_ray.engine_log == local.engine_log == [
        ("drain", 2), ("drain", 1), ("serve", 1, 1), ("serve", 2, 1)]
    assert on_ray.member_log == local.member_log == [
        ("start", 2), ("join", 2, 0), ("start", 1), ("join", 1, 0), ("stop", 1), ("stop", 2)]
    assert on_ray.roster == local.roster == [member_name(2), member_name(1)]
    assert on_ray.dispatched == local.dispatched == [1]
    assert all(on_ray.claims[member_name(i)] >= 1 for i in (1, 2))
    assert sum(on_ray.claims.values()) == sum(len(c.micro_batches) for c in chunks)
    _assert_gradients_close(on_ray.gradients, local.gradients)
    _assert_gradients_close(on_ray.gradients, expected)
    assert on_ray.loss == pytest.approx(local.loss, rel=1e-5)
    assert on_ray.loss == pytest.approx(expected_loss, rel=1e-5)

    # Each training cell was one actor in its own process, on its own (fake) GPU, holding
    # its cell's resource; all of it was given back when the cells returned to rollout.
    placed = [on_ray.placements[i][0] for i in (1, 2)]
    assert [p["name"] for p in placed] == [member_name(1), member_name(2)]
    assert len({p["pid"] for p in placed} | {os.getpid()}) == 3
    assert all(len(p["gpu_ids"]) == 1 for p in placed)
    assert placed[0]["gpu_ids"] != placed[1]["gpu_ids"]
    free = on_ray.placements["free"]
    assert [free.get(cell_resource(i), 0) for i in range(NUM_CELLS)] == [1, 0, 0]
    _until(lambda: ray.available_resources().get("GPU", 0) == NUM_CELLS, "the GPUs are free")
    assert ray_cluster["NodeManagerAddress"] == "127.0.0.1"


def test_a_cell_the_cluster_cannot_hold_is_refused(ray_cluster, tiny_model_dir):
    import ray

    from undertow.cells.elastic.ray_members import RayCell, RayMembers

    wide = RayMembers(("127.0.0.1", 1), tiny_model_dir,
                      RayCell(num_members=2, num_gpus_per_member=2), placement_timeout_s=2.0)
    with pytest.raises(CellPoolError, match="could not place cell 0"):
        wide.start(0)    # four GPUs on one node; the node has three
    assert wide.groups == {}
    _until(lambda: ray.available_resources().get("GPU", 0) == NUM_CELLS, "nothing is held")
