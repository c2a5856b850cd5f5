"""The training-side forward: a Hugging Face causal LM (any decoder of the Llama, Qwen2 or
Qwen3 families, tied head or not) scoring packed micro-batches. `PolicyModel.score` runs the
decoder once over a micro-batch's packed sequence with its ancestor-only mask and original
positions, and applies the LM head only at the terms' predictor positions; `score_path`
scores one path alone, the flat reference (`reference.py`). tests/learner/test_model.py
checks every way against one forward per path, on the tiny model and SmolLM2's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from undertow.learner.attention import (
    TREE_ATTENTION,
    attention_blocks,
    check_tree_attention,
    decoder_hidden,
    flex_block_mask,
    register_tree_attention,
)
from undertow.learner.causal_lm import CausalLM
from undertow.learner.lm_head import chunked_scores, head_scores
from undertow.learner.packing import MicroBatch
from undertow.learner.segments import SegmentedScorer, segmented_scores


@dataclass
class Scores:
    """Per term (N,): logprob of the token under the model, and entropy of the model's
    next-token distribution at its position (None unless asked for)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None


class PolicyModel:
    """A causal LM (transformers' `*ForCausalLM`) used for scoring and training. It
    needs of the model only what every such decoder has: `model.model` (the decoder,
    taking `input_ids`, `position_ids`, `attention_mask` and extra keyword arguments for
    the attention function), `model.get_output_embeddings()`, and full causal attention in
    every layer (`attention.check_tree_attention`).

    `head_chunk_tokens`: rows of the LM head per chunk (`lm_head.py`; 0 applies it to
    every scored position at once, the unchunked reference). `max_segment_tokens`: a
    micro-batch longer than this is scored in segments of this many positions
    (`segments.py`; 0 never); the default is `TrainConfig.max_tokens`'s, so that a
    micro-batch the packer had to make longer than its budget (a unit and its whole
    context, or a chain packed whole) keeps activations within the budget.
    `activation_checkpointing`: each decoder layer keeps only its input for the
    backward pass and is run again there (transformers' activation checkpointing,
    non-reentrant; the model is put in training mode for it, which changes nothing
    else in a model whose attention and MLP have no dropout, as these families'
    configs set; tree attention refuses a dropout).
    """

    def __init__(self, model: CausalLM, max_query_tokens: int = 8192,
                 head_chunk_tokens: int = 1024, max_segment_tokens: int = 8192,
                 activation_checkpointing: bool = False, attention: str = "auto"):
        for name, value in (("head_chunk_tokens", head_chunk_tokens),
                            ("max_segment_tokens", max_segment_tokens)):
            if value < 0:
                raise ValueError(f"PolicyModel.{name} must be >= 0 (0: off), got {value}")
        if model.config._attn_implementation == TREE_ATTENTION:
            check_tree_attention(model.config)
        self.model = model
        self.max_query_tokens = max_query_tokens
        self.head_chunk_tokens = head_chunk_tokens
        self.max_segment_tokens = max_segment_tokens
        self.attention = attention
        self.set_activation_checkpointing(activation_checkpointing)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             attn_implementation: str = TREE_ATTENTION, **options) -> PolicyModel:
        """`attn_implementation`: "undertow_tree" (blocks or dense), "sdpa" or "eager"
        (dense only); `options` are the constructor's."""
        from transformers import AutoModelForCausalLM

        if attn_implementation == TREE_ATTENTION:
            register_tree_attention()
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation=attn_implementation)
        # transformers types it as its generation base class, not the causal LM it is.
        return cls(cast(CausalLM, model), **options)

    def set_activation_checkpointing(self, enabled: bool) -> None:
        if enabled:
            self.model.activation_checkpointing_enable({"use_reentrant": False})
            self.model.train()
        elif getattr(self.model, "is_activation_checkpointing", False):
            self.model.activation_checkpointing_disable()
        self.activation_checkpointing = enabled

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def parameters(self):
        return self.model.parameters()

    def freeze(self, names: tuple[str, ...]) -> int:
        """Stops training the parameters named in `names` (a full name or a prefix ending
        at a dot); returns how many values that freezes. A tied parameter answers to each
        of its names (SmolLM2's `lm_head.weight` is `model.embed_tokens.weight`), and
        freezing one freezes both. ValueError for a name that matches no parameter."""
        num_frozen = 0
        every_name = list(self.model.named_parameters(remove_duplicate=False))
        for name in names:
            matched = [parameter for full, parameter in every_name
                       if full == name or full.startswith(name + ".")]
            if not matched:
                raise ValueError(f"learner.frozen: {name!r} names no parameter of the model; "
                                 "give a name or prefix of its named_parameters(), e.g. "
                                 f"{next(iter(dict(self.model.named_parameters())))!r}")
            for parameter in matched:
                num_frozen += parameter.numel() * parameter.requires_grad
                parameter.requires_grad_(False)
        return num_frozen

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    def score(self, micro_batch: MicroBatch, with_entropy: bool = False,
              attention: str = "auto") -> Scores:
        """Scores the micro-batch's terms from one forward over its packed sequence
        (in segments when it is longer than `max_segment_tokens` and the attention is
        "blocks"). `attention`: "blocks", "dense", "flex", or "auto" (the constructor's
        `attention` unless "auto"; else blocks when the model's attention is
        "undertow_tree"). "blocks": tree attention without a mask tensor (`attention.py`).
        "dense": a 4-D additive float mask (1, 1, T, T) through the model's attention,
        O(T^2) memory for the mask alone (1 GiB at T = 16k in fp32) and every masked pair
        computed (transformers 5 passes a 4-D float mask through unchanged; a 4-D bool
        mask is added as 0/1 by "eager"). "flex": flex_attention with a BlockMask of the
        tree, for CUDA; no segments."""
        attention = self.resolve_attention(attention)
        if attention == "blocks" and 0 < self.max_segment_tokens < micro_batch.num_tokens:
            scorer = SegmentedScorer(self.model, micro_batch, self.score_hidden,
                                     self.max_segment_tokens, self.max_query_tokens)
            anchor = self.model.get_output_embeddings().weight
            return Scores(*segmented_scores(anchor, scorer, with_entropy))
        tree_mask = dense_mask = None
        if attention == "blocks":
            tree_mask = attention_blocks(micro_batch, self.max_query_tokens)
        elif attention == "flex":
            tree_mask = flex_block_mask(micro_batch)
        else:
            dense_mask = micro_batch.attention_mask(self.dtype).to(micro_batch.token_ids.device)
            dense_mask = dense_mask[None, None]                          # (1, 1, T, T)
        hidden = decoder_hidden(self.model, micro_batch.token_ids, micro_batch.position_ids,
                                tree_mask, dense_mask)                   # (T, H)
        targets = micro_batch.token_ids[micro_batch.term_token_index]
        return Scores(*self.score_hidden(hidden[micro_batch.term_predictor_index], targets,
                                         with_entropy))

    def resolve_attention(self, attention: str = "auto") -> str:
        """The way `score` applies the mask: `attention`, else the constructor's, else
        "blocks" when the model's attention is "undertow_tree" and "dense" otherwise.
        ValueError for "blocks" or "flex" on a model loaded without "undertow_tree"."""
        if attention == "auto":
            attention = self.attention
        tree = self.model.config._attn_implementation == TREE_ATTENTION
        if attention == "auto":
            return "blocks" if tree else "dense"
        if attention in ("blocks", "flex") and not tree:
            raise ValueError(f"attention {attention!r} needs the model loaded with "
                             f"attn_implementation={TREE_ATTENTION!r}, not "
                             f"{self.model.config._attn_implementation!r}; use 'dense'")
        return attention

    def score_path(self, token_ids: torch.Tensor, scored: torch.Tensor,
                   with_entropy: bool = False) -> Scores:
        """Scores positions `scored` (each > 0) of one path run alone, causal mask."""
        hidden = decoder_hidden(self.model, token_ids)                   # (T, H)
        return Scores(*self.score_hidden(hidden[scored - 1], token_ids[scored], with_entropy))

    def score_hidden(self, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(N,) logprobs of `targets` and entropies at hidden rows (N, H)."""
        head = self.model.get_output_embeddings()
        if self.head_chunk_tokens:
            return chunked_scores(head, hidden, targets, with_entropy, self.head_chunk_tokens)
        return head_scores(head, hidden, targets, with_entropy)
