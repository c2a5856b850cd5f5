"""Tree attention: a packed micro-batch's ancestor-only attention without a mask tensor,
registered with transformers as the attention "undertow_tree" (`_tree_attention`): block
attention over chains of units (`attention_blocks`), or on CUDA flex_attention with a
`BlockMask` of the tree (`flex_block_mask`); cost and memory follow the tree's true
ancestor pairs, not T^2. `PolicyModel.score` reaches it through the decoder's `tree_mask`
keyword (docs/design.md, "From `undertow train` to the loss", step 9).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from undertow.learner.causal_lm import CausalLM
from undertow.learner.packing import MicroBatch

TREE_ATTENTION = "undertow_tree"
TREE_MASK = "tree_mask"


@dataclass(frozen=True)
class AttentionBlocks:
    """Query chunks of a packed sequence: chunk k attends from queries [start, end) to
    the keys `key_ranges` (ancestor tokens first, then its chain up to `end`), causal
    aligned to the bottom right. The chunks partition [query_offset, T') in order.

    Indices are packed positions. The query tensor holds rows [query_offset, ...) (0
    for a whole micro-batch, a segment's start for a segment), the key tensor every
    position from 0."""

    chunks: list[tuple[int, int, list[tuple[int, int]]]]
    query_offset: int = 0


class SegmentContext:
    """The attention "mask" of one segment [blocks.query_offset, end) of a long
    micro-batch: `past_keys[layer]`/`past_values[layer]` (1, KVH, start, D) are the
    keys and values of every position before the segment (None for the first), and
    the attention records the segment's own (1, KVH, n, D) in `own_keys`/`own_values`
    by layer index.

    Not a dataclass, on purpose: the layers must write into this very object. FSDP2
    rebuilds the dataclasses, lists and dicts among a unit's inputs (to hook its
    post-backward on every tensor that requires grad, to cast them under a mixed
    precision policy, to move them to the device), so each layer would record its keys
    into a copy of the one `segments.py` reads, and the past keys' gradients would
    pass through every unit's post-backward hook."""

    def __init__(self, blocks: AttentionBlocks, past_keys: list[torch.Tensor] | None = None,
                 past_values: list[torch.Tensor] | None = None):
        self.blocks = blocks
        self.past_keys, self.past_values = past_keys, past_values
        self.own_keys: dict[int, torch.Tensor] = {}
        self.own_values: dict[int, torch.Tensor] = {}

    def keys_and_values(self, layer: int, key: torch.Tensor, value: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Records the segment's own keys and values; returns all keys and values up to
        the segment's end, in packed order."""
        self.own_keys[layer], self.own_values[layer] = key, value
        if self.past_keys is None or self.past_values is None:  # (both are None or neither)
            return key, value
        return (torch.cat([self.past_keys[layer], key], dim=2),
                torch.cat([self.past_values[layer], value], dim=2))


def split_blocks(blocks: AttentionBlocks, bounds: list[tuple[int, int]]
                 ) -> list[AttentionBlocks]:
    """The chunks of `blocks` cut at the segment bounds [(start, end), ...] (which
    partition the sequence): one AttentionBlocks per segment, with its start as
    query offset. A chunk cut at e keeps its keys before e: the lower-right causal
    alignment then still gives each query exactly its ancestors and itself."""
    per_segment = []
    for start, end in bounds:
        chunks = []
        for chunk_start, chunk_end, ranges in blocks.chunks:
            a, b = max(chunk_start, start), min(chunk_end, end)
            if a < b:
                chunks.append((a, b, [(x, min(y, b)) for x, y in ranges if x < b]))
        per_segment.append(AttentionBlocks(chunks, query_offset=start))
    return per_segment


def attention_blocks(micro_batch: MicroBatch, max_query_tokens: int = 8192) -> AttentionBlocks:
    """Cuts a micro-batch into chains of units (runs of units each the child of the one
    before) and chains into query chunks of at most `max_query_tokens`; each chunk
    attends to its chain's ancestors' keys followed by its chain up to itself, causal
    aligned to the bottom right."""
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


def flex_block_mask(micro_batch: MicroBatch, block_size: int = 128) -> BlockMask:
    """The micro-batch's ancestor-only mask as a flex_attention BlockMask on the device of
    its tensors: query q may see key k iff k's unit is an ancestor-or-self of q's unit
    and k <= q (ancestors precede their descendants in the packing, so this is
    `MicroBatch.allowed`). Built tile by tile (compiled) on CUDA, where the kernel skips
    every tile no query may see; on a CPU the mask function is evaluated over the whole
    (T, T) grid once, and torch 2.13 runs flex_attention's forward only (no backward):
    there it is a checked reference, not a training path."""
    units = micro_batch.unit_index                                      # (T,)
    ancestors = micro_batch.unit_ancestors                              # (U, U)

    def allowed(batch, head, query, key):
        return ancestors[units[query], units[key]] & (key <= query)

    num_tokens = micro_batch.num_tokens
    device = units.device
    return create_block_mask(allowed, None, None, num_tokens, num_tokens, device=device,
                             BLOCK_SIZE=block_size, _compile=device.type == "cuda")


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once per process (eager flex_attention is a slow
    reference that materialises the scores)."""
    return torch.compile(flex_attention, dynamic=True)


def _flex_tree_attention(query, key, value, block_mask: BlockMask, scaling: float):
    """(1, H, T, D) queries, (1, KVH, T, D) keys and values -> (1, H, T, D)."""
    attend = _compiled_flex_attention() if query.device.type == "cuda" else flex_attention
    return attend(query, key, value, block_mask=block_mask, scale=scaling,
                  enable_gqa=query.shape[1] != key.shape[1])


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        elif end > start:
            merged.append((start, end))
    return merged


def decoder_hidden(model: CausalLM, token_ids: torch.Tensor,
                   position_ids: torch.Tensor | None = None,
                   tree_mask: AttentionBlocks | SegmentContext | BlockMask | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H) last hidden states of the causal LM `model`'s decoder (`model.model`) over
    one sequence `token_ids` (T,) at `position_ids` (T,) (None: 0..T-1), with the tree
    as `tree_mask` or a 4-D `attention_mask`, or neither (causal). The tree goes as the
    keyword `tree_mask`, not as `attention_mask`, which each decoder turns into its mask
    by its own rules (a Qwen decoder a dict per layer type, a Llama one a tensor), while
    every decoder passes extra keyword arguments through its layers unchanged (Llama,
    Qwen2 and Qwen3 of transformers 5, tested here)."""
    extra = {} if tree_mask is None else {TREE_MASK: tree_mask}
    return model.model(input_ids=token_ids[None],
                       position_ids=None if position_ids is None else position_ids[None],
                       attention_mask=attention_mask, use_cache=False,
                       **extra).last_hidden_state[0]                   # (T, H)


def check_tree_attention(config) -> None:
    """ValueError unless every attention layer of the model (its transformers `config`)
    is full causal attention, which is all that tree attention computes: it gives each
    query every ancestor key, more than a sliding-window layer was trained to see."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        others = sorted(set(layer_types) - {"full_attention"})
        if others:
            raise ValueError(f"{config.model_type} has {others} layers; tree attention "
                             "computes full causal attention only: load it with "
                             "attn_implementation='sdpa' and attention 'dense'")
    elif (getattr(config, "sliding_window", None) is not None
          and getattr(config, "use_sliding_window", True)):
        raise ValueError(f"{config.model_type} uses a sliding window of "
                         f"{config.sliding_window} tokens; tree attention computes full causal "
                         "attention only: load it with attn_implementation='sdpa' and "
                         "attention 'dense'")


def _tree_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    **kwargs):
    """transformers attention function: blockwise for `AttentionBlocks` (on CPU
    `_MergedBlockAttention`, elsewhere `_lower_right_attention`), flex_attention for a
    `BlockMask` (either given as `tree_mask`), one segment of a long micro-batch for a
    `SegmentContext` (`segments.py`: the keys and values of the segments before it come
    from the context, and its own are recorded there), else SDPA with `attention_mask`.
    query (1, H, T, D), key/value (1, KVH, T, D); returns (1, T, H, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tree_mask = kwargs.pop(TREE_MASK, None)
    if tree_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if isinstance(tree_mask, SegmentContext):
        key, value = tree_mask.keys_and_values(module.layer_idx, key, value)
        tree_mask = tree_mask.blocks
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast (learner.mixed_precision) a model with q/k norms (Qwen3) returns
        # float32 q and k while v is bf16; the kernels below are not autocast ops, so
        # give them one dtype.
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if isinstance(tree_mask, BlockMask):
        output = _flex_tree_attention(query, key, value, tree_mask,
                                      query.shape[-1] ** -0.5 if scaling is None else scaling)
        return output.transpose(1, 2).contiguous(), None                # (1, T, H, D)
    attention_mask = tree_mask
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
        rows = slice(start - blocks.query_offset, end - blocks.query_offset)
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, rows], keys, values, attn_mask=bias, scale=scaling,
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
            offset = blocks.query_offset
            chunk = query[:, :, start - offset:end - offset]               # (1, H, q, D)
            parts = [flash(chunk, key[:, :, a:b], value[:, :, a:b], 0.0, causal,
                           scale=scaling) for a, b, causal in _chunk_parts(start, end, ranges)]
            if len(parts) == 1:
                outputs.append(parts[0][0])
                lses.append(parts[0][1])
                continue
            part_lse = torch.stack([lse for _, lse in parts])              # (P, 1, H, q)
            lse = torch.logsumexp(part_lse, dim=0)                         # (1, H, q)
            weights = torch.exp(part_lse - lse)[..., None]                 # (P, 1, H, q, 1)
            merged = weights[0] * parts[0][0].to(weights.dtype)
            for w, (out, _) in zip(weights[1:], parts[1:], strict=True):
                merged = merged + w * out.to(w.dtype)
            outputs.append(merged.to(query.dtype))
            lses.append(lse)
        output = torch.cat(outputs, dim=2)                                 # (1, H, T, D)
        lse = torch.cat(lses, dim=2)                                       # (1, H, T)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.blocks, ctx.scaling = blocks, scaling
        return output

    @staticmethod
    def backward(ctx, *grad_outputs):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        query, key, value, output, lse = ctx.saved_tensors
        grad_output = grad_outputs[0].contiguous()
        grads = [torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)]
        offset = ctx.blocks.query_offset
        for start, end, ranges in ctx.blocks.chunks:
            rows = slice(start - offset, end - offset)
            for a, b, causal in _chunk_parts(start, end, ranges):
                grad_q, grad_k, grad_v = backward(
                    grad_output[:, :, rows], query[:, :, rows], key[:, :, a:b],
                    value[:, :, a:b], output[:, :, rows], lse[:, :, rows], 0.0, causal,
                    scale=ctx.scaling)
                grads[0][:, :, rows] += grad_q
                grads[1][:, :, a:b] += grad_k
                grads[2][:, :, a:b] += grad_v
        return *grads, None, None


def register_tree_attention() -> None:
    """Makes "undertow_tree" known to transformers (idempotent), without a mask function
    of its own, so a decoder builds no (T, T) mask for it (transformers' packed-sequence
    detection would otherwise build one from the tree's restarting positions): without
    `tree_mask` it gets the 4-D mask it was given (the dense path) or none, and runs SDPA
    causally (one path alone, the flat path)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, _tree_attention)


