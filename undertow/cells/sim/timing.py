"""The engine and learner timing models of the simulator (`simulator.py`): `EngineModel`
and `TrainerModel`, each read from a workload's `engine` and `trainer` sections."""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class EngineModel:
    """Timing of one rollout cell's engine: continuous batching as processor sharing.

    Every sequence generating on the engine advances one token per decode step, and one
    decode step of `b` sequences holding `c` tokens of context in all takes
    `decode_step_s(b, c)` = `decode_base_s` + `decode_per_sequence_s` * b +
    `decode_per_kilotoken_s` * c / 1000 (reading the weights, per-sequence compute,
    attention over the KV cache). Prefill is chunked into decode steps: each prompt token
    costs 1 / `prefill_chunk_tokens` of a step for its sequence. The engine holds at most
    `num_session_slots` sessions (its KV capacity); a session keeps its slot for its whole
    life, tool calls included, as an agent's prefix stays cached.
    """

    num_session_slots: int
    decode_base_s: float
    decode_per_sequence_s: float
    decode_per_kilotoken_s: float
    prefill_chunk_tokens: int
    migration_pause_s: float = 0.03

    def __post_init__(self):
        if self.num_session_slots < 1:
            raise ValueError(f"engine.num_session_slots={self.num_session_slots}; need >= 1")
        if self.decode_base_s <= 0 or self.prefill_chunk_tokens < 1:
            raise ValueError(f"engine: decode_base_s={self.decode_base_s} must be > 0 and "
                             f"prefill_chunk_tokens={self.prefill_chunk_tokens} >= 1")
        if min(self.decode_per_sequence_s, self.decode_per_kilotoken_s,
               self.migration_pause_s) < 0:
            raise ValueError("engine: per-sequence, per-kilotoken and migration costs must be >= 0")

    def decode_step_s(self, num_sequences: int, context_tokens: float) -> float:
        return (self.decode_base_s + self.decode_per_sequence_s * num_sequences
                + self.decode_per_kilotoken_s * context_tokens / 1000)

    def turn_steps(self, prefill_tokens: int, completion_tokens: int) -> float:
        """Decode steps one turn needs from its sequence: chunked prefill, then its tokens."""
        return math.ceil(prefill_tokens / self.prefill_chunk_tokens) + completion_tokens


@dataclasses.dataclass(frozen=True)
class TrainerModel:
    """Timing of the learner and of role switches.

    Data-parallel training at `tokens_per_s_per_cell` unique tokens per second on each
    training cell (shared prefixes counted once, as the tree packer does), then an
    optimizer step and a weight sync that do not depend on the batch. `train_unit` says
    what becomes trainable when: a whole `group` once its last session ends (group-relative
    advantages need every reward; the default), or each `session` as it ends (a baseline
    that needs no group). A role switch costs by default what QwenGyre measured
    (`switch_to_training_s`, `switch_to_rollout_s`).
    """

    tokens_per_s_per_cell: float
    optimizer_step_s: float
    weight_sync_s: float
    switch_to_training_s: float = 8.52
    switch_to_rollout_s: float = 3.46
    train_unit: str = "group"

    def __post_init__(self):
        if self.train_unit not in ("group", "session"):
            raise ValueError(f"trainer.train_unit={self.train_unit!r}; use 'group' or 'session'")
        if self.tokens_per_s_per_cell <= 0:
            raise ValueError(f"trainer.tokens_per_s_per_cell={self.tokens_per_s_per_cell}; "
                             "need > 0")
        for field in ("optimizer_step_s", "weight_sync_s", "switch_to_training_s",
                      "switch_to_rollout_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"trainer.{field}={getattr(self, field)}; need >= 0")
