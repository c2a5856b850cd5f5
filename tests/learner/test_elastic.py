"""The elastic learner's gradient equals a fixed membership's (issue 7).

Three long-lived member processes (spawned once for the module by the local pool's
`ProcessMembers`, gloo over a TCP store on 127.0.0.1) train steps of the tiny model
on random trees packed into >= 6 micro-batches: one member; two from the start; one
at the start, a second joining after the first micro-batch is claimed and a third
later. Each time: every parameter's summed gradient equals the single-process
`backward_step` gradient within 1e-5 of its scale, every micro-batch is claimed
exactly once, and every member trained with the coordinator's current weights (their
digest), which change between steps. Members are paced through
`Coordinator.release`, so who claims what is deterministic where the test needs it,
with no sleeps.
"""

import time

import pytest
import torch

from tests.learner.test_losses import _advantages, _assert_gradients_close, _gradients
from undertow.learner.elastic import Coordinator, MembershipError, weights_digest
from undertow.learner.losses import LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.pool.local import ProcessMembers, member_name

pytestmark = pytest.mark.slow

TIMEOUT_S = 180.0
A, B, C = (member_name(i) for i in range(3))
CONFIG = LossConfig(name="grpo", correction="decoupled_ppo", entropy_coef=0.01,
                    max_importance_weight=1.5)


class Cluster:
    """The coordinator in this process and the member processes (cells 0, 1, 2)."""

    def __init__(self, coordinator, members):
        self.coordinator, self.members = coordinator, members
        self.next_step = 0
        self.seen_digests: set[str] = set()

    def join(self, cell_id, step):
        self.members.join(cell_id, step)

    def open_step(self, packed, num_released=None):
        """Moves the coordinator's weights (so a stale member would be caught) and
        opens the next step; returns (step, digest, expected gradients, stats)."""
        policy = self.coordinator.policy
        step, self.next_step = self.next_step, self.next_step + 1
        generator = torch.Generator().manual_seed(100 + step)
        with torch.no_grad():
            for parameter in policy.model.parameters():
                parameter.add_(1e-3 * torch.randn(parameter.shape, generator=generator))
        policy.model.zero_grad(set_to_none=True)
        stats = backward_step(policy, packed, CONFIG)
        expected = _gradients(policy)
        digest = self.coordinator.open_step(step, packed, CONFIG, num_released)
        assert digest == weights_digest(policy.model) and digest not in self.seen_digests
        self.seen_digests.add(digest)
        return step, digest, expected, stats

    def until(self, predicate, what):
        deadline = time.monotonic() + TIMEOUT_S
        while not predicate():
            for process, _inbox in self.members.running.values():
                assert process.is_alive(), f"{process.name} died while waiting until {what}"
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    policy = PolicyModel.load(tiny_model_dir, dtype=torch.float32)
    policy.model.train()
    coordinator = Coordinator(policy, tmp_path_factory.mktemp("elastic"), timeout_s=TIMEOUT_S)
    members = ProcessMembers(coordinator.address, tiny_model_dir, timeout_s=TIMEOUT_S)
    try:
        for cell_id in range(3):
            members.start(cell_id)
        yield Cluster(coordinator, members)
    finally:
        members.close()
        coordinator.close()


@pytest.fixture(scope="module")
def packed(random_trees):
    step = pack_step(random_trees, _advantages(random_trees), 40)
    assert len(step.micro_batches) >= 6
    return step


def _check(result, cluster, packed, digest, expected, stats, members):
    policy = cluster.coordinator.policy
    _assert_gradients_close(_gradients(policy), expected)
    claimed = [index for name in members for index in result.claims[name]]
    assert sorted(claimed) == list(range(len(packed.micro_batches)))
    assert result.ranks == ["coordinator", *members]
    assert result.weights_digests == dict.fromkeys(members, digest)
    for name in ("loss", "num_terms", "num_clipped", "entropy_sum"):
        assert result.stats[name] == pytest.approx(stats[name], rel=1e-5)


def test_one_member_equals_a_fixed_membership(cluster, packed):
    step, digest, expected, stats = cluster.open_step(packed)
    cluster.join(0, step)
    result = cluster.coordinator.finish_step()
    _check(result, cluster, packed, digest, expected, stats, [A])


def test_two_members_from_the_start_split_the_step(cluster, packed):
    step, digest, expected, stats = cluster.open_step(packed, num_released=0)
    cluster.join(0, step)
    cluster.join(1, step)
    coordinator = cluster.coordinator
    cluster.until(lambda: len(coordinator.members()) == 2 and coordinator.num_claimed() >= 2,
           "both members hold a ticket")
    result = coordinator.finish_step()
    assert sorted(result.ranks[1:]) == sorted([A, B])
    _check(result, cluster, packed, digest, expected, stats, result.ranks[1:])
    assert all(result.claims[name] for name in (A, B))


def test_members_joining_mid_step_give_the_fixed_membership_gradient(cluster, packed):
    coordinator = cluster.coordinator
    step, digest, expected, stats = cluster.open_step(packed, num_released=1)
    cluster.join(0, step)
    # a trained micro-batch 0 and holds ticket 1, which is not released yet.
    cluster.until(lambda: coordinator.num_claimed() >= 2, "a claimed the first micro-batch")
    cluster.join(1, step)
    cluster.until(lambda: coordinator.num_claimed() >= 3, "b holds ticket 2")
    assert coordinator.members() == [A, B]
    coordinator.release(3)
    # a and b train 1 and 2, then draw tickets 3 and 4, which wait for their release.
    cluster.until(lambda: coordinator.num_claimed() >= 5, "tickets 3 and 4 are drawn")
    assert coordinator.num_claimed() == 5
    cluster.join(2, step)
    cluster.until(lambda: coordinator.num_claimed() >= 6, "c holds ticket 5")
    result = coordinator.finish_step()
    _check(result, cluster, packed, digest, expected, stats, [A, B, C])
    assert 0 in result.claims[A] and 2 in result.claims[B] and 5 in result.claims[C]


def test_a_member_arriving_after_the_roster_closed_waits_for_the_next_step(cluster, packed):
    coordinator = cluster.coordinator
    step, digest, expected, stats = cluster.open_step(packed)
    cluster.join(0, step)
    result = coordinator.finish_step()
    cluster.join(2, step)           # too late: refused, and c stays usable
    step, digest, expected, stats = cluster.open_step(packed)
    cluster.join(2, step)
    result = coordinator.finish_step()
    _check(result, cluster, packed, digest, expected, stats, [C])


def test_finishing_without_members_times_out_with_advice(tiny_model_dir, tmp_path, packed):
    coordinator = Coordinator(PolicyModel.load(tiny_model_dir), tmp_path, timeout_s=0.2)
    try:
        coordinator.open_step(0, packed, CONFIG)
        with pytest.raises(MembershipError, match="move a cell to training"):
            coordinator.finish_step()
    finally:
        coordinator.close()
