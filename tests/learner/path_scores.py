"""The exactness check the packed-scoring tests share: every trained token's logprob and
entropy from one packed micro-batch equal those of its path scored alone."""

import pytest
import torch

from undertow.learner.model import PolicyModel
from undertow.learner.reference import flat_samples


def assert_scores_equal_per_path(step, scores, trees, advantages, flat: PolicyModel) -> None:
    """`scores` (of `step`'s first micro-batch, which must hold every term) against `flat`
    scoring each sample's path alone, token by token, matched by behaviour logprob."""
    micro_batch = step.micro_batches[0]
    by_behaviour = {float(step.behaviour_logprobs[t]): (lp, h) for t, lp, h in zip(
        micro_batch.term_ids.tolist(), scores.logprobs.tolist(), scores.entropy.tolist(),
        strict=True)}
    num_checked = 0
    with torch.no_grad():
        for sample in flat_samples(trees, advantages):
            path = flat.score_path(sample.token_ids, sample.scored, with_entropy=True)
            for behaviour, logprob, entropy in zip(sample.behaviour.tolist(),
                                                   path.logprobs.tolist(),
                                                   path.entropy.tolist(), strict=True):
                assert by_behaviour[behaviour] == pytest.approx((logprob, entropy), abs=1e-5)
                num_checked += 1
    assert num_checked == step.num_terms
