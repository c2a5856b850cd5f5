"""The streamed elastic step's gradient equals a fixed membership's full-batch gradient
(issue 7).

The reference is the plain learner's step: `backward_step` on the packed trees of all
the step's groups at once, in one process. The streamed step packs each group alone,
as `ElasticLearner.add_group` does when the group completes, and appends the groups in
varying orders to a step that is already open; members join between micro-steps.

- In one process, for every loss variant (aggregation x off-policy correction, with KL
  and entropy terms): the groups' unnormalised micro-batch gradients, summed in a
  shuffled order and divided by the step's count, equal the reference gradient within
  1e-5 of each parameter's scale; and the unnormalised weights over the whole step's
  count equal the step's normaliser weights for every loss.
- Three long-lived member processes (spawned once for the module by the local pool's
  `ProcessMembers`, gloo over a TCP store on 127.0.0.1), one streamed step per loss
  aggregation: member a joins an empty step and trains the first group alone; b joins
  after it; two more groups arrive; c joins; the last group arrives. Each time every
  parameter's summed gradient equals the reference, every micro-batch is claimed
  exactly once, and every member trained with the coordinator's current weights
  (their digest), which change between steps.
Members are paced by the appends, so who claims what is deterministic where the test
needs it, with no sleeps.
"""

import random
import time

import pytest
import torch

from tests.learner.random_trees import build_random_tree
from tests.learner.test_losses import VARIANTS, _assert_gradients_close, _gradients
from undertow.cells.elastic.local import ProcessMembers, member_name
from undertow.cells.elastic.step import (
    Coordinator,
    MembershipError,
    weights_digest,
)
from undertow.learner.advantages import group_advantages
from undertow.learner.config import AdvantageConfig, LossConfig
from undertow.learner.errors import EmptyStepError
from undertow.learner.losses import LOSSES, chunk_weights, step_count, step_weights
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_micro_batch, backward_step
from undertow.learner.packing import pack_step

pytestmark = pytest.mark.slow

TIMEOUT_S = 180.0
MAX_TOKENS = 40
A, B, C = (member_name(i) for i in range(3))
STREAMED = [LossConfig(name="token_mean", correction="tis", max_importance_weight=1.5),
            LossConfig(name="grpo", correction="decoupled_ppo", entropy_coef=0.01,
                       max_importance_weight=1.5),
            LossConfig(name="dr_grpo", correction="none", dr_grpo_num_tokens=64),
            LossConfig(name="gyre", correction="decoupled_ppo", max_paths_per_session=1,
                       max_importance_weight=1.5)]


def _group_advantages(tree):
    return {(tree.group_id, s): a for s, a in group_advantages(tree, AdvantageConfig()).items()}


def _whole_step(trees, config):
    advantages = {key: a for tree in trees for key, a in _group_advantages(tree).items()}
    return pack_step(trees, advantages, MAX_TOKENS, config.paths_per_session)


def _chunks(trees, config):
    """Each group packed alone, as `ElasticLearner.add_group` packs it."""
    return [pack_step([tree], _group_advantages(tree), MAX_TOKENS, config.paths_per_session)
            for tree in trees]


@pytest.fixture(scope="module")
def trees():
    """Four groups of three sessions with branches, of different sizes."""
    return [build_random_tree(seed, f"g{seed}", num_turns=3 + seed % 3) for seed in range(1, 5)]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_chunk_weights_over_the_step_count_are_the_step_weights(trees, name):
    config = LossConfig(name=name, max_paths_per_session=1)
    chunks = _chunks(trees, config)
    streamed = torch.cat([chunk_weights(config, c) for c in chunks])
    streamed /= sum(step_count(config, c) for c in chunks)
    whole = _whole_step(trees, config)
    # The whole step numbers its terms tree by tree, in the trees' order, as the chunks do.
    assert torch.allclose(streamed, step_weights(config, whole), rtol=1e-12, atol=0)


@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: f"{c.name}-{c.correction}"
                         + ("-kl" if c.kl_coef else "") + ("-ent" if c.entropy_coef else ""))
def test_streamed_groups_sum_to_the_fixed_step_gradient(trees, policy32, reference32, config):
    policy32.model.zero_grad(set_to_none=True)
    expected_stats = backward_step(policy32, _whole_step(trees, config), config, reference32)
    expected = _gradients(policy32)
    chunks = _chunks(trees, config)
    random.Random(config.name + config.correction).shuffle(chunks)
    loss = 0.0
    for chunk in chunks:
        weights = chunk_weights(config, chunk)
        for index in range(len(chunk.micro_batches)):
            loss += backward_micro_batch(policy32, chunk, weights, index, config,
                                         reference32)["loss"]
    count = sum(step_count(config, chunk) for chunk in chunks)
    streamed = {name: grad / count for name, grad in _gradients(policy32).items()}
    _assert_gradients_close(streamed, expected)
    assert loss / count == pytest.approx(expected_stats["loss"], rel=1e-5,
                                         abs=1e-5 * expected_stats["loss_abs_sum"])


class Cluster:
    """The coordinator in this process and the member processes (cells 0, 1, 2)."""

    def __init__(self, coordinator, members):
        self.coordinator, self.members = coordinator, members
        self.next_step = 0
        self.seen_digests: set[str] = set()

    def join(self, cell_id, step):
        self.members.join(cell_id, step)

    def open_step(self, trees, config):
        """Moves the coordinator's weights (so a stale member would be caught) and
        opens the next step; returns (step, digest, expected gradients, stats)."""
        policy = self.coordinator.policy
        step, self.next_step = self.next_step, self.next_step + 1
        generator = torch.Generator().manual_seed(100 + step)
        with torch.no_grad():
            for parameter in policy.model.parameters():
                parameter.add_(1e-3 * torch.randn(parameter.shape, generator=generator))
        policy.model.zero_grad(set_to_none=True)
        stats = backward_step(policy, _whole_step(trees, config), config)
        expected = _gradients(policy)
        digest = self.coordinator.open_step(step, config)
        assert digest == weights_digest(policy.model) and digest not in self.seen_digests
        self.seen_digests.add(digest)
        return step, digest, expected, stats

    def until_drawn(self, num_tickets, what):
        """Waits until `num_tickets` tickets are drawn (members hold the last ones)."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.coordinator.num_claimed() < num_tickets:
            for member in self.members.running.values():
                for process in member.processes:
                    assert process.is_alive(), f"{process.name} died while waiting until {what}"
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.02)
        assert self.coordinator.num_claimed() == num_tickets, what


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


def _check(result, cluster, digest, expected, stats, members):
    policy = cluster.coordinator.policy
    _assert_gradients_close(_gradients(policy), expected)
    claimed = [index for name in members for index in result.claims[name]]
    assert sorted(claimed) == list(range(result.num_micro_batches))
    assert result.ranks == ["coordinator", *members]
    assert result.weights_digests == dict.fromkeys(members, digest)
    for name in ("loss", "num_terms", "num_clipped"):
        assert result.stats[name] == pytest.approx(stats[name], rel=1e-5,
                                                   abs=1e-5 * stats["loss_abs_sum"])


@pytest.mark.parametrize("config", STREAMED, ids=lambda c: c.name)
def test_a_streamed_step_with_members_joining_equals_the_fixed_membership(
        cluster, trees, config):
    coordinator = cluster.coordinator
    chunks = _chunks(trees, config)
    order = [(i + STREAMED.index(config)) % len(chunks) for i in range(len(chunks))]
    sizes = [len(chunks[i].micro_batches) for i in order]
    step, digest, expected, stats = cluster.open_step(trees, config)
    cluster.join(0, step)
    cluster.until_drawn(1, "a waits on the empty queue")
    coordinator.append(chunks[order[0]])
    # a trains every micro-batch of the first group, then waits on the next ticket.
    cluster.until_drawn(sizes[0] + 1, "a trained the first group")
    cluster.join(1, step)
    cluster.until_drawn(sizes[0] + 2, "b joined and waits")
    assert coordinator.members() == [A, B]
    coordinator.append(chunks[order[1]])
    coordinator.append(chunks[order[2]])
    num_before_last = sum(sizes[:3])
    cluster.until_drawn(num_before_last + 2, "a and b trained three groups")
    cluster.join(2, step)
    cluster.until_drawn(num_before_last + 3, "c joined and waits")
    coordinator.append(chunks[order[3]])
    result = coordinator.finish_step()
    _check(result, cluster, digest, expected, stats, [A, B, C])
    assert result.num_chunks == 4 and result.num_micro_batches == sum(sizes)
    assert set(range(sizes[0])) <= set(result.claims[A])
    assert result.claims[B] and min(result.claims[B]) >= sizes[0]
    assert all(index >= num_before_last for index in result.claims[C])


def test_late_or_aborted_members_train_only_their_next_step(cluster, trees):
    coordinator, config = cluster.coordinator, STREAMED[1]
    chunks = _chunks(trees, config)
    step, digest, expected, stats = cluster.open_step(trees, config)
    cluster.join(0, step)
    for chunk in chunks:
        coordinator.append(chunk)
    coordinator.finish_step()
    cluster.join(2, step)           # too late: refused, and c stays usable
    # c trains a group of a step that is then aborted: its gradient must not leak.
    step, digest, expected, stats = cluster.open_step(trees, config)
    cluster.join(2, step)
    cluster.until_drawn(1, "c waits on the empty queue")
    coordinator.append(chunks[0])
    cluster.until_drawn(len(chunks[0].micro_batches) + 1, "c trained a group")
    coordinator.abort_step()
    step, digest, expected, stats = cluster.open_step(trees, config)
    cluster.join(2, step)
    for chunk in chunks:
        coordinator.append(chunk)
    result = coordinator.finish_step()
    _check(result, cluster, digest, expected, stats, [C])


def test_finishing_without_members_or_terms_fails_with_advice(tiny_model_dir, tmp_path, trees):
    coordinator = Coordinator(PolicyModel.load(tiny_model_dir), tmp_path, timeout_s=0.2)
    config = STREAMED[0]
    try:
        coordinator.open_step(0, config)
        with pytest.raises(EmptyStepError, match="no trainable token"):
            coordinator.finish_step()
        assert not coordinator.step_open
        coordinator.open_step(1, config)
        coordinator.append(_chunks(trees, config)[0])
        with pytest.raises(MembershipError, match="move a cell to training"):
            coordinator.finish_step()
    finally:
        coordinator.close()
