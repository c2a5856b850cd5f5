"""Scoring a long micro-batch in segments of positions, exactly, in memory that follows the
segment: `PolicyModel.score` cuts a micro-batch longer than `max_segment_tokens` (a
128k-token path, or a group tree packed whole) into segments of consecutive packed
positions. Packing is depth-first, so every key a token attends to lies at or before it, and
segment k needs only the keys and values of the positions before it (docs/training.md,
"Long paths").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from undertow.learner.attention import (
    SegmentContext,
    attention_blocks,
    decoder_hidden,
    split_blocks,
)
from undertow.learner.causal_lm import CausalLM
from undertow.learner.packing import MicroBatch

HeadFn = Callable[[torch.Tensor, torch.Tensor, bool],
                  tuple[torch.Tensor, torch.Tensor | None]]
"""(hidden rows (n, H), targets (n,), with_entropy) -> (n,) logprobs, (n,) entropy."""


class SegmentedScorer:
    """One micro-batch cut into segments of at most `segment_tokens` positions."""

    def __init__(self, model: CausalLM, micro_batch: MicroBatch, head: HeadFn,
                 segment_tokens: int, max_query_tokens: int):
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        self.model, self.micro_batch, self.head = model, micro_batch, head
        num_tokens = micro_batch.num_tokens
        self.bounds = [(start, min(start + segment_tokens, num_tokens))
                       for start in range(0, num_tokens, segment_tokens)]
        self.blocks = split_blocks(attention_blocks(micro_batch, max_query_tokens), self.bounds)
        predictors = micro_batch.term_predictor_index
        self.terms = [((predictors >= start) & (predictors < end)).nonzero()[:, 0]
                      for start, end in self.bounds]
        self.keys: list[torch.Tensor] = []     # per layer (1, KVH, T, D)
        self.values: list[torch.Tensor] = []

    def run(self, index: int, past_keys: list[torch.Tensor] | None,
            past_values: list[torch.Tensor] | None, with_entropy: bool
            ) -> tuple[SegmentContext, torch.Tensor, torch.Tensor | None]:
        """Segment `index` forward: its context (own keys and values recorded) and its
        terms' (n,) logprobs and entropies."""
        start, end = self.bounds[index]
        context = SegmentContext(self.blocks[index], past_keys, past_values)
        hidden = decoder_hidden(self.model, self.micro_batch.token_ids[start:end],
                                self.micro_batch.position_ids[start:end], context)  # (n, H)
        terms = self.terms[index]
        targets = self.micro_batch.token_ids[self.micro_batch.term_token_index[terms]]
        rows = self.micro_batch.term_predictor_index[terms] - start
        logprobs, entropy = self.head(hidden[rows], targets, with_entropy)
        return context, logprobs, entropy

    def past(self, tensors: list[torch.Tensor], index: int, leaves: bool
             ) -> list[torch.Tensor] | None:
        """Each layer's keys (or values) before segment `index`: views of the store, as
        leaves that collect their gradient when `leaves`."""
        start = self.bounds[index][0]
        if start == 0:
            return None
        views = [t[:, :, :start] for t in tensors]
        return [v.detach().requires_grad_() for v in views] if leaves else views

    def store(self, context: SegmentContext, index: int) -> None:
        start, end = self.bounds[index]
        layers = sorted(context.own_keys)
        if not self.keys:
            num_tokens = self.micro_batch.num_tokens
            for layer in layers:
                own = context.own_keys[layer]
                shape = (*own.shape[:2], num_tokens, own.shape[3])
                self.keys.append(own.new_empty(shape))
                self.values.append(own.new_empty(shape))
        for layer in layers:
            self.keys[layer][:, :, start:end] = context.own_keys[layer]
            self.values[layer][:, :, start:end] = context.own_values[layer]


def segmented_scores(anchor: torch.Tensor, scorer: SegmentedScorer, with_entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N,) logprobs and entropies (or None) of the micro-batch's terms, in its term
    order. `anchor` is a parameter of the model: the result needs an input that
    requires grad to take part in a backward pass."""
    logprobs, entropy = _SegmentedScores.apply(anchor, scorer, with_entropy)
    return logprobs, entropy if with_entropy else None


class _SegmentedScores(torch.autograd.Function):
    """Keeps a store of every layer's keys and values (1, KVH, T, D), no activations.
    Forward, no graph: each segment runs the decoder on its tokens with the store's
    earlier keys and values (`attention.SegmentContext`), writes its own into the store
    and scores the terms whose predictor lies in it. Backward, segments in reverse:
    segment k runs again with the graph on, its earlier keys and values given as leaves;
    one backward from its terms' gradients plus those later segments sent to its own
    keys and values accumulates its parameters' gradients and yields the gradients at
    the earlier keys and values, added to the store's gradient: the chain rule through
    the keys and values, so the gradient equals the unsegmented one
    (tests/learner/test_chunked_scoring.py). Memory: one segment's activations plus the
    store and its gradient (2 * layers * KVH * D per token each). As torch's reentrant
    checkpoint does, the backward accumulates into `.grad` by its own backward call: a
    loss over these scores must use `.backward()`, not `torch.autograd.grad`."""

    @staticmethod
    def forward(ctx, anchor, scorer: SegmentedScorer, with_entropy: bool):
        num_terms = scorer.micro_batch.term_ids.numel()
        logprobs = entropy = None
        for index in range(len(scorer.bounds)):
            context, part, part_entropy = scorer.run(
                index, scorer.past(scorer.keys, index, False),
                scorer.past(scorer.values, index, False), with_entropy)
            scorer.store(context, index)
            if logprobs is None or entropy is None:  # (both are set together)
                logprobs = part.new_zeros(num_terms)
                entropy = part.new_zeros(num_terms)
            logprobs[scorer.terms[index]] = part
            if part_entropy is not None:  # with_entropy
                entropy[scorer.terms[index]] = part_entropy
        ctx.scorer, ctx.with_entropy = scorer, with_entropy
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_logprobs, grad_entropy = grad_outputs
        scorer = ctx.scorer
        grad_keys = [torch.zeros_like(t) for t in scorer.keys]
        grad_values = [torch.zeros_like(t) for t in scorer.values]
        for index in reversed(range(len(scorer.bounds))):
            with torch.enable_grad():
                past_keys = scorer.past(scorer.keys, index, True)
                past_values = scorer.past(scorer.values, index, True)
                context, logprobs, entropy = scorer.run(index, past_keys, past_values,
                                                        ctx.with_entropy)
                reshard_inner_units(scorer.model)
                outputs, grads = _segment_grads(scorer, index, context, logprobs, entropy,
                                                grad_logprobs, grad_entropy, grad_keys,
                                                grad_values)
                torch.autograd.backward(outputs, grads)
            for past, grad_store in ((past_keys, grad_keys), (past_values, grad_values)):
                for leaf, grad in zip(past or [], grad_store, strict=False):
                    if leaf.grad is not None:
                        grad[:, :, :leaf.shape[2]] += leaf.grad
        scorer.keys, scorer.values = [], []
        return None, None, None


def _segment_grads(scorer: SegmentedScorer, index: int, context: SegmentContext,
                   logprobs, entropy, grad_logprobs, grad_entropy, grad_keys, grad_values):
    """The outputs of segment `index` that receive a gradient, and those gradients.
    The logprobs are always among them (zeros for a segment without terms), so that
    every segment's backward runs through the LM head and every layer: under FSDP2
    (`sharding.py`) a backward must enter every unit through its output, since FSDP2
    gathers a layer's weights when the gradient at its output arrives (the gradients
    at its own keys alone would reach the key and value projections ungathered) and
    the LM head's reduce-scatter would be skipped on this process but not on others.
    So each segment's backward is one backward of every unit, and the reduced gradient
    is the sum over segments."""
    terms = scorer.terms[index]
    outputs = [logprobs]
    grads = [logprobs.new_zeros(terms.numel()) if grad_logprobs is None
             else grad_logprobs[terms]]
    if entropy is not None and grad_entropy is not None and terms.numel():
        outputs.append(entropy)
        grads.append(grad_entropy[terms])
    start, end = scorer.bounds[index]
    if end < scorer.micro_batch.num_tokens:     # later segments read these keys/values
        for layer in sorted(context.own_keys):
            outputs += [context.own_keys[layer], context.own_values[layer]]
            grads += [grad_keys[layer][:, :, start:end], grad_values[layer][:, :, start:end]]
    return outputs, grads


def reshard_inner_units(model: nn.Module) -> None:
    """Frees the gathered weights of every FSDP2 unit nested in another (the decoder
    layers of a sharded model), as FSDP2 does after a forward everywhere but inside a
    backward, where it takes the forward for activation checkpointing's recompute and
    keeps them for the unit's backward. A segment's forward in `_SegmentedScores.backward`
    is an ordinary forward: resharded, it holds one layer's weights at a time, and it
    issues the all-gathers an ordinary forward and backward does. No-op unsharded."""
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            for inner in unit.modules():
                if inner is not unit and isinstance(inner, FSDPModule):
                    inner.reshard()
