"""`undertow sft`: a warm start by cross-entropy on stored trajectories' sampled tokens.

The trajectories are gateway trees (a tree store directory, `STORE/<group>.jsonl`):
e.g. oracle solutions of the bundled tasks driven through the real scaffold by a
scripted model, so that the tokens are exactly those the scaffold's calls carried.
Each step packs its groups with the RL packer (`packing.pack_step`, each shared
prefix computed once) and minimises the mean negative logprob over the trainable
tokens of the step (a token mean: no RL loss, so no `LossConfig`), so the packed loss
equals the flat per-session one as in RL. Sessions below
`min_reward` (when set) are left out; the result is a model directory (`--out`) that
`undertow train` takes as `run.model_dir`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from undertow.gateway.trees.tree import Tree
from undertow.learner.checkpoint import write_model_dir
from undertow.learner.config import SFTConfig, torch_dtype
from undertow.learner.metrics_log import MetricsLog
from undertow.learner.model import PolicyModel
from undertow.learner.packing import PackedStep, SessionKey, pack_step


def chosen_sessions(trees: list[Tree], min_reward: float | None) -> dict[SessionKey, float]:
    """The sessions to imitate (weight 1 each): closed ones at or above `min_reward`."""
    return {(tree.group_id, sid): 1.0 for tree in trees for sid, paths in tree.sessions.items()
            if min_reward is None or (paths.reward is not None and paths.reward >= min_reward)}


def cross_entropy_backward(policy: PolicyModel, step: PackedStep) -> tuple[float, int]:
    """Backpropagates the step's mean negative logprob (every trainable token of the step
    weighs the same, 1 / their number); returns it and the token count."""
    total = 0.0
    for micro_batch in step.micro_batches:
        logprobs = policy.score(micro_batch).logprobs   # (N,) one per term of the micro-batch
        loss = -logprobs.sum() / step.num_terms
        loss.backward()
        total += float(loss.detach())
    return total, step.num_terms


def run_sft(trees: list[Tree], model_dir: Path, out_dir: Path, config: SFTConfig) -> Path:
    """Trains from `model_dir` on `trees`; writes the model to `out_dir` and per-step
    metrics to `out_dir/metrics.jsonl`; returns `out_dir`."""
    sessions = chosen_sessions(trees, config.min_reward)
    trees = [t for t in trees if any((t.group_id, s) in sessions for s in t.sessions)]
    if not trees:
        raise ValueError(f"no session to imitate (min_reward={config.min_reward}); "
                         "check the store and sft.min_reward")
    torch.manual_seed(config.seed)
    policy = PolicyModel.load(model_dir, dtype=torch_dtype(config.dtype))
    policy.model.train()
    policy.freeze(config.frozen)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    out_dir = Path(out_dir)
    metrics = MetricsLog(out_dir)
    order, rng, step_index = list(range(len(trees))), random.Random(config.seed), 0
    for _ in range(config.num_epochs):
        rng.shuffle(order)
        for start in range(0, len(order), config.groups_per_step):
            started_s = time.perf_counter()
            batch = [trees[i] for i in order[start:start + config.groups_per_step]]
            keys = {k: v for k, v in sessions.items() if k[0] in {t.group_id for t in batch}}
            step = pack_step(batch, keys, config.max_tokens)
            optimizer.zero_grad(set_to_none=True)
            loss, num_tokens = cross_entropy_backward(policy, step)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(),
                                                       config.max_grad_norm)
            optimizer.step()
            step_index += 1
            metrics.append(step_index, 0, {
                "loss": loss, "grad_norm": float(grad_norm), "num_groups": len(batch),
                "num_sessions": len(keys), "num_trained_tokens": num_tokens,
                "train_s": time.perf_counter() - started_s})
    write_model_dir(policy.model, model_dir, out_dir)
    return out_dir
