"""Where the learner's parameters live: the device, the precision (`place`), and FSDP2
shards in a training cell (`shard_policy`, `sharded_backward_step`), a group of devices that
trains as one member of an elastic step (`undertow/cells/elastic/`). Each process keeps 1/W
of the parameters, gradients and optimizer state; a layer's full parameters exist only while
it runs. What a user sets and sees: docs/cluster.md, "Sharded cells".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from undertow.learner.attention import decoder_hidden
from undertow.learner.config import DEVICES, MIXED_PRECISIONS, LossConfig, TrainConfig
from undertow.learner.errors import LearnerError
from undertow.learner.lm_head import ScoringHead
from undertow.learner.losses import step_weights
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_micro_batch, merge_stats, sequence_keep_of
from undertow.learner.packing import MicroBatch, PackedStep

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

TOKEN_MULTIPLE = 256
ACTIVATION_SAFETY = 2.0


class DeviceError(LearnerError):
    """The configured device cannot be used here."""


def resolve_device(name: str) -> torch.device:
    """The device `learner.device` names: "auto" is CUDA when torch sees a GPU, else CPU.
    In a process of a multi-GPU cell, CUDA means the current device (`LOCAL_RANK`'s)."""
    if name not in DEVICES:
        raise ValueError(f"learner.device must be one of {DEVICES}, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"learner.device is 'cuda' but this torch ({torch.__version__}) sees "
                          "no CUDA device; install a CUDA build or set learner.device: auto")
    return torch.device("cuda", torch.cuda.current_device())


def compute_context(device: torch.device, mixed_precision: str):
    """The context a single (unsharded) process runs its forward and backward in."""
    if mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Placement:
    """Where one unsharded learner process trains: its device, its micro-batch token
    bound (resolved from `TrainConfig.micro_batch_tokens`) and its compute precision."""

    device: torch.device
    max_tokens: int
    mixed_precision: str = "none"

    def compute(self):
        """The context to run forwards and backwards in."""
        return compute_context(self.device, self.mixed_precision)

    def prepare(self, step: PackedStep) -> PackedStep:
        """The packed step on the device."""
        return step_to(step, self.device)


def place(config: TrainConfig, policy: PolicyModel,
          reference: PolicyModel | None = None) -> Placement:
    """Moves the policy (and the reference) to `config.device`, sets activation
    checkpointing and the attention from the config, and resolves the micro-batch
    token bound; returns the placement."""
    device = resolve_device(config.device)
    if config.attention == "flex" and device.type != "cuda":
        raise DeviceError(f"learner.attention is 'flex' but the learner runs on {device}: "
                          "torch has no flex_attention backward there; use 'auto'")
    for model in (policy, reference):
        if model is not None:
            model.model.to(device)
            model.attention = config.attention
    policy.set_activation_checkpointing(config.activation_checkpointing)
    max_tokens = config.max_tokens
    if isinstance(config.micro_batch_tokens, int):
        max_tokens = config.micro_batch_tokens
    elif config.micro_batch_tokens == "auto":
        max_tokens = device_token_budget(policy, device, 1, config.mixed_precision) or max_tokens
    return Placement(device, max_tokens, config.mixed_precision)


def micro_batch_to(micro_batch: MicroBatch, device: torch.device) -> MicroBatch:
    """The micro-batch with its tensors on `device` (itself if they are there)."""
    if micro_batch.token_ids.device == device:
        return micro_batch
    moved = {f.name: getattr(micro_batch, f.name).to(device)
             for f in dataclasses.fields(micro_batch)
             if isinstance(getattr(micro_batch, f.name), torch.Tensor)}
    return dataclasses.replace(micro_batch, **moved)


def step_to(step: PackedStep, device: torch.device) -> PackedStep:
    """The packed step with every tensor on `device` (term arrays and micro-batches)."""
    moved = {name: getattr(step, name).to(device)
             for name in ("term_session", "term_path", "behaviour_logprobs", "advantages",
                          "term_version_gap")}
    return dataclasses.replace(step, micro_batches=[micro_batch_to(mb, device)
                                                    for mb in step.micro_batches], **moved)


def activation_bytes_per_token(config: Any, compute_bytes: int,
                               activation_checkpointing: bool) -> float:
    """An upper estimate of the activation bytes one packed token keeps for backward in a
    decoder of attention and gated-MLP layers (Llama, Qwen2, Qwen3; `config`: its
    transformers config): per layer the attention's q, k, v
    and output and the MLP's gate, up and product, with `ACTIVATION_SAFETY` for autograd's
    extra copies; with checkpointing every layer keeps only its input, and one layer's
    activations are alive at a time."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", hidden // config.num_attention_heads)
    attention = (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layer = (4 * hidden + attention + 3 * config.intermediate_size) * compute_bytes
    layer *= ACTIVATION_SAFETY
    if activation_checkpointing:
        return config.num_hidden_layers * hidden * compute_bytes + layer
    return config.num_hidden_layers * layer


def micro_batch_token_budget(config: Any, free_bytes: int, num_parameters: int,
                             num_shards: int, compute_bytes: int,
                             activation_checkpointing: bool, head_chunk_tokens: int) -> int:
    """The most packed tokens per micro-batch that fit in `free_bytes` of device memory,
    measured with the (sharded) float32 parameters already on the device: their
    gradients (4 bytes) and AdamW's two moments (8 bytes) per local parameter still to
    come, one layer's gathered parameters in `compute_bytes`, the LM head's chunk of
    float32 logits and their gradient, then `activation_bytes_per_token` per token.
    Rounded down to a multiple of `TOKEN_MULTIPLE`; DeviceError when not even that fits."""
    local = num_parameters / num_shards
    fixed = 12 * local + compute_bytes * num_parameters / max(config.num_hidden_layers, 1)
    fixed += 2 * 4 * max(head_chunk_tokens, 1) * config.vocab_size
    per_token = activation_bytes_per_token(config, compute_bytes, activation_checkpointing)
    tokens = int((free_bytes - fixed) / per_token) // TOKEN_MULTIPLE * TOKEN_MULTIPLE
    if tokens < TOKEN_MULTIPLE:
        raise DeviceError(f"{free_bytes / 2**30:.1f} GiB free leaves no room for a micro-batch "
                          f"of {TOKEN_MULTIPLE} tokens; shard over more devices, enable "
                          "learner.activation_checkpointing, or set learner.micro_batch_tokens")
    return tokens


def device_token_budget(policy: PolicyModel, device: torch.device, num_shards: int,
                        mixed_precision: str) -> int | None:
    """`micro_batch_token_budget` from the CUDA device's free memory now; None on a CPU
    (whose memory the budget does not come from)."""
    if device.type != "cuda":
        return None
    free_bytes, _ = torch.cuda.mem_get_info(device)
    num_parameters = sum(p.numel() for p in policy.model.parameters()) * (
        num_shards if _is_sharded(policy) else 1)
    compute_bytes = 2 if mixed_precision == "bf16" else policy.dtype.itemsize
    return micro_batch_token_budget(policy.model.config, free_bytes, num_parameters,
                                    num_shards, compute_bytes, policy.activation_checkpointing,
                                    policy.head_chunk_tokens)


def shard_policy(policy: PolicyModel, mesh, mixed_precision: str = "none") -> None:
    """Shards the policy's causal LM over `mesh` in place: each decoder layer, then the
    root (decoder, embedding, final norm), then the LM head unless it shares the
    embedding's weight; parameter names do not change. A tied head (SmolLM2, Qwen2.5 up
    to 3B, Qwen3 up to 4B) reads the root's gathered embedding; a head of its own
    (Qwen2.5-7B, Qwen3-8B and larger) is a unit, a `ScoringHead` computing the chunked
    scores, so FSDP2 gathers its weight for them and reduce-scatters its gradient after
    their backward. It is a second root, not resharded between its forward and backward:
    its whole weight (V x H in the compute dtype) lives until their backward ends.
    "bf16": float32 master weights and optimizer state, bf16 all-gathers, float32
    reduce-scatters. Each unit prefetches the next one's weights in the backward by an
    explicit list (`_prefetch_in_layer_order`), not by the recorded order of forwards, in
    which FSDP2 records no forward run inside a backward (a segment's).
    FSDP2 averages the gradients over the mesh; `sharded_backward_step` scales them back
    to the sum (a divide factor of 1 would need a PREMUL_SUM reduction, which gloo lacks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISIONS}, "
                         f"got {mixed_precision!r}")
    options: dict[str, Any] = {"mesh": mesh}
    if mixed_precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    model = policy.model
    embedding = model.get_input_embeddings()
    tied = model.get_output_embeddings().weight is embedding.weight   # before sharding
    layers = [fully_shard(layer, **options) for layer in model.model.layers]
    # The root unit is the decoder, not the causal LM: `PolicyModel.score` calls the
    # decoder and applies the head itself, so the causal LM's forward hook never runs.
    _prefetch_in_layer_order(fully_shard(model.model, **options), layers)
    if tied:
        model.lm_head = _TiedHead(embedding)
    else:
        model.lm_head = ScoringHead(model.get_output_embeddings())
        fully_shard(model.lm_head, **options)


def sharded_backward_step(policy: PolicyModel, step: PackedStep, config: LossConfig,
                          rank: int, world_size: int, reference: PolicyModel | None = None
                          ) -> dict[str, float]:
    """This process's share of the cell's step: micro-batches rank, rank + W, ... in
    rounds that every process of the mesh runs together (every forward all-gathers and
    every backward reduce-scatters across the whole mesh); accumulates the step's sharded
    gradient into `.grad` and returns this process's summed stats. Each micro-batch's
    loss carries the whole step's normaliser and the mean is scaled back to the sum, so
    the gradient is the one process's sum over all micro-batches, up to the order of
    float additions (tests/learner/test_sharding.py)."""
    device = _device_of(policy)
    step = step_to(step, device)
    weights = step_weights(config, step)
    sequence_keep_of(policy, step, config)   # on every process: its forwards are collectives
    num_rounds = math.ceil(len(step.micro_batches) / world_size)
    totals: dict[str, float] = {}
    for round_index in range(num_rounds):
        first = round_index * world_size
        index = first + rank
        stats = round_pass(policy, device, step.micro_batches[first:first + world_size], rank,
                           lambda index=index: backward_micro_batch(
                               policy, step, weights, index, config, reference))
        merge_stats(totals, stats)
    mean_to_sum(policy, world_size)
    return totals


def round_pass(policy: PolicyModel, device: torch.device, micro_batches: list[MicroBatch],
               rank: int, backward: Callable[[], dict[str, float]]) -> dict[str, float]:
    """This process's part of one round of a sharded step, in which process i trains
    `micro_batches[i]` (processes past the list's end have none): `backward()` (the
    forward, loss and backward of `micro_batches[rank]`, returning its stats) or an idle
    pass, padded with idle forwards and passes to the round's longest micro-batch so
    that every process of the mesh issues the same collectives in the same order. When
    the longest has S > 1 segments, each process runs S forwards, then S forwards each
    with a backward, idle forwards (no graph) before its own and idle passes after (a
    micro-batch scored whole is one forward with a backward): an idle process costs up
    to 2S one-token passes, and a segment all-gathers each layer three times where a
    whole micro-batch does twice. Returns the stats, empty for an idle process."""
    num_segments = max(segments_of(policy, micro_batch) for micro_batch in micro_batches)
    own = segments_of(policy, micro_batches[rank]) if rank < len(micro_batches) else 0
    if num_segments == 1:
        if own:
            return backward()
        idle_pass(policy, device)
        return {}
    own_forwards = own if own > 1 else 0     # a whole micro-batch's forward is in its pass
    for _ in range(num_segments - own_forwards):
        idle_forward(policy, device)
    stats = backward() if own else {}
    for _ in range(num_segments - own):
        idle_pass(policy, device)
    return stats


def segments_of(policy: PolicyModel, micro_batch: MicroBatch) -> int:
    """How many segments `PolicyModel.score` scores the micro-batch in (1: whole)."""
    attention = policy.resolve_attention()
    if attention == "blocks" and 0 < policy.max_segment_tokens < micro_batch.num_tokens:
        return math.ceil(micro_batch.num_tokens / policy.max_segment_tokens)
    return 1


def mean_to_sum(policy: PolicyModel, world_size: int) -> None:
    """Scales the sharded gradient FSDP2 averaged over the mesh back to its sum."""
    with torch.no_grad():
        for parameter in policy.model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(world_size)


def full_parameters(policy: PolicyModel) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered from the mesh when sharded), on the CPU. A
    collective: every process of the mesh must call it."""
    from torch.distributed.tensor import DTensor

    full = {}
    for name, parameter in policy.model.named_parameters():
        tensor = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        full[name] = tensor.detach().cpu()
    return full


def idle_pass(policy: PolicyModel, device: torch.device) -> None:
    """A forward and backward on one token with a zero loss, through the decoder and the
    head's scores as a micro-batch goes, so that a process with no micro-batch left joins
    every unit's all-gathers and reduce-scatters."""
    (_idle_scores(policy, device).sum() * 0.0).backward()


def idle_forward(policy: PolicyModel, device: torch.device) -> None:
    """`idle_pass`'s forward alone, with no graph: the all-gathers of one segment's
    forward in the scores of a segmented micro-batch."""
    with torch.no_grad():
        _idle_scores(policy, device)


def _idle_scores(policy: PolicyModel, device: torch.device) -> torch.Tensor:
    token_ids = torch.zeros(1, dtype=torch.long, device=device)                 # (1,)
    hidden = decoder_hidden(policy.model, token_ids)                            # (1, H)
    return policy.score_hidden(hidden, token_ids, False)[0]                    # (1,)


def _prefetch_in_layer_order(decoder: FSDPModule, layers: list[FSDPModule]) -> None:
    """Sets each unit of the sharded decoder to prefetch, in the backward, the weights
    of the unit whose backward comes next: the root the last layer's, each layer the one
    below, the first layer the root's (gathered already: no collective). FSDP2's default
    picks the unit recorded before this one among the forwards since the last backward,
    which skips a forward that runs inside a backward (a segment's), so two processes
    could prefetch differently and their collectives would no longer pair up."""
    decoder.set_modules_to_backward_prefetch([layers[-1]])
    for below, layer in zip([decoder, *layers[:-1]], layers, strict=True):
        layer.set_modules_to_backward_prefetch([below])


def _device_of(policy: PolicyModel) -> torch.device:
    from torch.distributed.tensor import DTensor

    parameter = next(policy.model.parameters())
    local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
    return local.device


def _is_sharded(policy: PolicyModel) -> bool:
    return hasattr(next(policy.model.parameters()), "to_local")


class _TiedHead(nn.Module):
    """The LM head of a sharded model whose head shares the embedding's weight: the
    weight is read from the embedding at each use, so it is the gathered weight while
    the root unit's parameters are whole (from the decoder's forward to the end of the
    backward) and its gradient is reduced with the embedding's."""

    bias = None

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self._embedding = [embedding]   # a list: not a submodule, its weight is the root's

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight)
