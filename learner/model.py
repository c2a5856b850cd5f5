"""The training-side forward: a Hugging Face Qwen3 model scoring packed micro-batches.

`PolicyModel.load(model_dir)` loads the model directory with transformers'
`AutoModelForCausalLM`. `score(micro_batch)` runs the decoder once over the packed
sequence with the micro-batch's ancestor-only mask, given as a 4-D additive float
mask (1, 1, T, T), and its original position IDs, then applies the LM head only at
the terms' predictor positions and returns each term's logprob (and entropy).
transformers 5.x passes a 4-D float mask through unchanged for both the "eager" and
"sdpa" attention of Qwen3 (a 4-D *bool* mask is NOT honoured by "eager": it is
added as 0/1), which tests/learner/test_model.py checks against one forward per path.

Two ways to apply the mask, by `attention=`:
- "dense": the (1, 1, T, T) float mask through the model's attention ("eager" or
  "sdpa"). Memory O(T^2) for the mask alone (1 GiB at T = 16k in fp32), and the
  attention computes every masked pair too.
- "blocks" (default): the micro-batch is cut into chains (runs of units each the
  child of the one before) and chains into query chunks of at most
  `max_query_tokens`; each chunk attends to its chain's ancestors' keys followed by
  its chain up to itself, causal aligned to the bottom right. No mask tensor: on CPU
  each chunk's keys are split into the part every query sees in full and the chunk's
  own causal square, each run by the flash kernel and merged exactly by their
  log-sum-exp (`_MergedBlockAttention`); elsewhere one SDPA per chunk with a
  lower-right causal bias (a flash kernel on CUDA). Cost and memory follow the tree's
  true ancestor pairs, not T^2: a shared prefix's keys are computed once and read by
  every chain below it. Chunking only bounds the query rows of one kernel call
  (memory stays O(T) either way), so the default is large.
  It is registered with transformers as the attention "undertow_tree", which falls
  back to SDPA whenever it is given an ordinary mask (the flat path).

The flat reference (`reference.py`) uses `score_path`: one path alone with the
model's own causal mask and default positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from undertow.learner.packing import MicroBatch

TREE_ATTENTION = "undertow_tree"


@dataclass(frozen=True)
class AttentionBlocks:
    """Query chunks of a packed sequence: chunk k attends from queries [start, end) to
    the keys `key_ranges` (ancestor tokens first, then its chain up to `end`), causal
    aligned to the bottom right. The chunks partition [0, T) in order."""

    chunks: list[tuple[int, int, list[tuple[int, int]]]]


def attention_blocks(micro_batch: MicroBatch, max_query_tokens: int = 8192) -> AttentionBlocks:
    """Cuts a micro-batch into chains of units and chains into query chunks."""
    starts, ends = [], []
    position = 0
    index_of = {key: i for i, key in enumerate(micro_batch.unit_keys)}
    units = micro_batch.unit_index
    counts = torch.bincount(units, minlength=len(micro_batch.unit_keys)).tolist()
    for count in counts:
        starts.append(position)
        position += count
        ends.append(position)
    parents = micro_batch.unit_parents
    chunks = []
    first = 0
    for i in range(len(counts) + 1):
        if i < len(counts) and i > first and parents[i] == micro_batch.unit_keys[i - 1]:
            continue
        if i > first:
            ancestors, walk = [], parents[first]
            while walk is not None:
                ancestors.append(index_of[walk])
                walk = micro_batch.unit_parents[index_of[walk]]
            ranges = _merge([(starts[a], ends[a]) for a in reversed(ancestors)])
            chain_start, chain_end = starts[first], ends[i - 1]
            for start in range(chain_start, chain_end, max_query_tokens):
                end = min(start + max_query_tokens, chain_end)
                chunks.append((start, end, _merge(ranges + [(chain_start, end)])))
        first = i
    return AttentionBlocks(chunks)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return merged


def _tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    **kwargs):
    """transformers attention function: blockwise for `AttentionBlocks`, else SDPA.
    query (1, H, T, D), key/value (1, KVH, T, D); returns (1, T, H, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, AttentionBlocks):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError(f"block attention has no dropout (got {dropout}); set the model "
                         "config's attention_dropout to 0")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if query.device.type == "cpu":
        output = _MergedBlockAttention.apply(query, key, value, attention_mask, scaling)
    else:
        output = _lower_right_attention(query, key, value, attention_mask, scaling)
    return output.transpose(1, 2).contiguous(), None                    # (1, T, H, D)


def _lower_right_attention(query, key, value, blocks: AttentionBlocks, scaling: float):
    """Per chunk, one SDPA over its gathered keys with a lower-right causal bias: on
    CUDA this is a flash kernel without a mask tensor. (1, H, T, D)."""
    from torch.nn.attention.bias import causal_lower_right

    outputs = []
    for start, end, ranges in blocks.chunks:
        keys = torch.cat([key[:, :, a:b] for a, b in ranges], dim=2)      # (1, KVH, K, D)
        values = torch.cat([value[:, :, a:b] for a, b in ranges], dim=2)
        bias = causal_lower_right(end - start, keys.shape[2])
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], keys, values, attn_mask=bias, scale=scaling,
            enable_gqa=query.shape[1] != keys.shape[1]))                 # (1, H, q, D)
    return torch.cat(outputs, dim=2)


def _chunk_parts(start: int, end: int, ranges: list[tuple[int, int]]
                 ) -> list[tuple[int, int, bool]]:
    """A chunk's keys as (a, b, causal) parts: every key before the chunk is seen in full
    by each of its queries, and the chunk's own keys [start, end) causally."""
    parts = [(a, min(b, start), False) for a, b in ranges if min(b, start) > a]
    return parts + [(start, end, True)]


class _MergedBlockAttention(torch.autograd.Function):
    """Block attention on CPU without a mask: each chunk's attention is split into
    parts (`_chunk_parts`) run by PyTorch's CPU flash kernel, which returns each part's
    log-sum-exp, and merged exactly (softmax over the union of the parts' keys). A
    lower-right bias on CPU would be materialised as a (q, K) mask per chunk and layer,
    computed over every masked pair and kept for backward (4x the memory, about 1.4x the
    backward time at 14k tokens). The backward runs the flash backward of each part
    with the merged output and log-sum-exp, which is the merged attention's gradient
    restricted to that part's keys (the identity ring attention relies on). Parts are
    slices of the packed keys: no gathered copies. Keeps only q, k, v, output, lse."""

    @staticmethod
    def forward(ctx, query, key, value, blocks: AttentionBlocks, scaling: float):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        outputs, lses = [], []
        for start, end, ranges in blocks.chunks:
            chunk = query[:, :, start:end]                                 # (1, H, q, D)
            parts = [flash(chunk, key[:, :, a:b], value[:, :, a:b], 0.0, causal,
                           scale=scaling) for a, b, causal in _chunk_parts(start, end, ranges)]
            if len(parts) == 1:
                outputs.append(parts[0][0])
                lses.append(parts[0][1])
                continue
            part_lse = torch.stack([lse for _, lse in parts])              # (P, 1, H, q)
            lse = torch.logsumexp(part_lse, dim=0)                         # (1, H, q)
            weights = torch.exp(part_lse - lse)[..., None]                 # (P, 1, H, q, 1)
            merged = sum(w * out.to(w.dtype) for w, (out, _) in zip(weights, parts, strict=True))
            outputs.append(merged.to(query.dtype))
            lses.append(lse)
        output = torch.cat(outputs, dim=2)                                 # (1, H, T, D)
        lse = torch.cat(lses, dim=2)                                       # (1, H, T)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.blocks, ctx.scaling = blocks, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        query, key, value, output, lse = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grads = [torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)]
        for start, end, ranges in ctx.blocks.chunks:
            rows = slice(start, end)
            for a, b, causal in _chunk_parts(start, end, ranges):
                grad_q, grad_k, grad_v = backward(
                    grad_output[:, :, rows], query[:, :, rows], key[:, :, a:b],
                    value[:, :, a:b], output[:, :, rows], lse[:, :, rows], 0.0, causal,
                    scale=ctx.scaling)
                grads[0][:, :, rows] += grad_q
                grads[1][:, :, a:b] += grad_k
                grads[2][:, :, a:b] += grad_v
        return *grads, None, None


def _register_tree_attention() -> None:
    """Makes "undertow_tree" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, _tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)


@dataclass
class Scores:
    """Per term (N,): logprob of the token under the model, and entropy of the model's
    next-token distribution at its position (None unless asked for)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


class PolicyModel:
    """A causal LM (transformers' Qwen3ForCausalLM) used for scoring and training."""

    def __init__(self, model: nn.Module, max_query_tokens: int = 8192):
        self.model = model
        self.max_query_tokens = max_query_tokens

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             attn_implementation: str = TREE_ATTENTION) -> PolicyModel:
        """`attn_implementation`: "undertow_tree" (blocks or dense), "sdpa" or "eager"
        (dense only)."""
        from transformers import AutoModelForCausalLM

        if attn_implementation == TREE_ATTENTION:
            _register_tree_attention()
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation=attn_implementation)
        return cls(model)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def parameters(self):
        return self.model.parameters()

    def score(self, micro_batch: MicroBatch, with_entropy: bool = False,
              attention: str = "auto") -> Scores:
        """Scores the micro-batch's terms from one forward over its packed sequence.
        `attention`: "blocks", "dense", or "auto" (blocks when the model's attention
        is "undertow_tree")."""
        if attention == "auto":
            tree = self.model.config._attn_implementation == TREE_ATTENTION
            attention = "blocks" if tree else "dense"
        if attention == "blocks":
            # A dict is taken by transformers as masks already prepared per layer type.
            mask = {"full_attention": attention_blocks(micro_batch, self.max_query_tokens)}
        else:
            mask = micro_batch.attention_mask(self.dtype)[None, None]  # (1, 1, T, T)
        hidden = self.model.model(
            input_ids=micro_batch.token_ids[None],
            position_ids=micro_batch.position_ids[None],
            attention_mask=mask, use_cache=False).last_hidden_state[0]  # (T, H)
        targets = micro_batch.token_ids[micro_batch.term_token_index]
        return self._score_hidden(hidden, micro_batch.term_predictor_index, targets,
                                  with_entropy)

    def score_path(self, token_ids: torch.Tensor, scored: torch.Tensor,
                   with_entropy: bool = False) -> Scores:
        """Scores positions `scored` (each > 0) of one path run alone, causal mask."""
        hidden = self.model.model(input_ids=token_ids[None],
                                  use_cache=False).last_hidden_state[0]  # (T, H)
        return self._score_hidden(hidden, scored - 1, token_ids[scored], with_entropy)

    def _score_hidden(self, hidden: torch.Tensor, predictor_index: torch.Tensor,
                      targets: torch.Tensor, with_entropy: bool) -> Scores:
        logits = self.model.get_output_embeddings()(hidden[predictor_index])  # (N, V)
        log_probs = torch.log_softmax(logits.float() if logits.dtype in (
            torch.float16, torch.bfloat16) else logits, dim=-1)
        logprobs = log_probs.gather(-1, targets[:, None])[:, 0]
        entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
        return Scores(logprobs, entropy)
