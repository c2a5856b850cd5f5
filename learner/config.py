"""The learner's configuration sections: one frozen dataclass per section of the run config.

A run config (`undertow train -c CONFIG`) has, for the learner, the sections `learner`
(`TrainConfig`: the loop, optimiser, checkpoints), `loss` (`LossConfig`, the objective of
`losses.py`), `advantages` (`AdvantageConfig`, of `advantages.py` and `group_filter.py`),
`logging` (`TrackerConfig`, of `trackers.py`) and, for `undertow sft`, `sft` (`SFTConfig`).
`undertow/config.py`'s `build_section` builds each from its own section; every bad value
is a `ValueError` that names it. No torch here: the run's sections are read and checked
before any of the learner's heavy modules is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from undertow.learner.errors import LossConfigError

DTYPES = ("float32", "float64", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
MIXED_PRECISIONS = ("none", "bf16")
ATTENTIONS = ("auto", "blocks", "flex", "dense")
LONG_PATHS = ("split", "whole")     # packing.LONG_PATHS, without importing torch here
LOSS_NAMES = ("token_mean", "grpo", "dr_grpo", "gyre")   # losses.LOSSES' keys, as above
CORRECTION_NAMES = ("none", "decoupled_ppo", "tis", "mis")   # losses.CORRECTIONS' keys
SEQUENCE_MASKS = ("none", "geometric")
SCALES = ("std", "none")
TIMEOUT_REWARDS = ("partial_credit", "tree_value", "drop")
TRACKERS = ("tensorboard", "wandb", "mlflow")
WANDB_MODES = ("offline", "online", "disabled")


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value}")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop (`train.py`).

    Steps and groups: step k (1-based) trains `groups_per_step` finished groups of
    `group_size` sessions each and publishes weight version k (version 0 is the
    initial model). Staleness: a group is launched only while the newest published
    version is at least (the step it is for) - `max_staleness`, so with 0 the loop
    is synchronous and with 1 rollouts for step k+1 run while step k trains. A group
    whose oldest sampled token is more than `max_staleness` versions older than the
    weights it would train is dropped and replaced when `drop_stale`, else trained.

    `max_failed_groups`: that many groups in a row whose every session Undertow failed
    (after each slot's attempts), or whose sessions the time limit cut so that fewer than
    two are left to train (`advantages.timeout_reward="drop"`), stop the run with one
    error naming the cause.

    `max_tokens` bounds a packed micro-batch, unless `micro_batch_tokens` is set: a
    number, or "auto" to derive the bound from the device's free memory at start
    (`sharding.micro_batch_token_budget`; `max_tokens` on a CPU).

    Device and precision (`sharding.py`): `device` "auto" trains on the GPU when torch
    sees one, else the CPU. `mixed_precision` "bf16" keeps the parameters and AdamW's
    state in `dtype` (float32: the master weights) and computes in bfloat16.
    `activation_checkpointing` keeps one decoder layer's activations at a time.
    `attention`: how the packed tree's mask is applied (`model.py`; "auto" is block
    tree attention, "flex" is flex_attention, for CUDA).

    Long paths (`packing.pack_step`, `model.py`): `long_paths` "split" packs a subtree
    unit by unit, each micro-batch with its units' whole context, and stops the run
    with an error naming this field when a path with its context is longer than the
    micro-batch bound; "whole" (the default) packs such a path once, whole, in a
    micro-batch of its own, which the policy scores in segments of `max_segment_tokens`
    positions (None: the micro-batch bound; 0: never in segments) reusing the earlier
    segments' keys and values, exactly (`segments.py`). `head_chunk_tokens`: the LM
    head's rows per chunk (`lm_head.py`; 0: every scored position at once, an (N, V)
    float32 tensor).

    `frozen`: parameters the run does not train, by name as `named_parameters` gives them
    or a prefix of it ("model.embed_tokens", "lm_head"): no gradient and no AdamW state
    (12 bytes a float32 parameter; 3.3 GB for Qwen2.5-0.5B's untied embedding and head),
    and every saved model keeps their start values. A name that matches no parameter is
    an error (`model.PolicyModel.freeze`).

    Checkpoints are written every
    `checkpoint_every` steps and after the last one; the last `keep_checkpoints`
    are kept (the weights of every step are written anyway, to push them).
    """

    num_steps: int = 2
    groups_per_step: int = 1
    group_size: int = 2
    max_staleness: int = 1
    drop_stale: bool = True
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    max_tokens: int = 8192
    seed: int = 0
    dtype: str = "float32"
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    push_mode: str = "drain"
    group_timeout_s: float = 3600.0
    max_failed_groups: int = 4
    device: str = "auto"
    mixed_precision: str = "none"
    activation_checkpointing: bool = False
    micro_batch_tokens: int | str | None = None
    attention: str = "auto"
    long_paths: str = "whole"
    max_segment_tokens: int | None = None
    head_chunk_tokens: int = 1024
    frozen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        owner = "learner"
        for name in ("num_steps", "groups_per_step", "group_size", "max_tokens",
                     "checkpoint_every", "keep_checkpoints", "max_failed_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{owner}.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"{owner}.max_staleness must be >= 0, got {self.max_staleness}")
        _check_positive(owner, lr=self.lr, adam_eps=self.adam_eps,
                        max_grad_norm=self.max_grad_norm, group_timeout_s=self.group_timeout_s)
        if self.weight_decay < 0:
            raise ValueError(f"{owner}.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"{owner}.beta1 and beta2 must be in [0, 1), got "
                             f"{self.beta1}, {self.beta2}")
        if self.dtype not in DTYPES:
            raise ValueError(f"{owner}.dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name, choices in (("device", DEVICES), ("mixed_precision", MIXED_PRECISIONS),
                              ("attention", ATTENTIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{owner}.{name} must be one of {choices}, "
                                 f"got {getattr(self, name)!r}")
        tokens = self.micro_batch_tokens
        if not (tokens is None or tokens == "auto" or (type(tokens) is int and tokens >= 1)):
            raise ValueError(f"{owner}.micro_batch_tokens must be a number >= 1 or 'auto', "
                             f"got {tokens!r}")
        self._check_long_paths(owner)
        if self.push_mode not in ("drain", "abort_resume"):
            raise ValueError(f"{owner}.push_mode must be 'drain' or 'abort_resume', "
                             f"got {self.push_mode!r}")

    def _check_long_paths(self, owner: str) -> None:
        if self.long_paths not in LONG_PATHS:
            raise ValueError(f"{owner}.long_paths must be one of {LONG_PATHS}, "
                             f"got {self.long_paths!r}")
        segment = self.max_segment_tokens
        if not (segment is None or (type(segment) is int and segment >= 0)):
            raise ValueError(f"{owner}.max_segment_tokens must be a number >= 0 (0: never in "
                             f"segments) or null (the micro-batch bound), got {segment!r}")
        if type(self.head_chunk_tokens) is not int or self.head_chunk_tokens < 0:
            raise ValueError(f"{owner}.head_chunk_tokens must be a number >= 0 (0: unchunked), "
                             f"got {self.head_chunk_tokens!r}")

    def segment_tokens(self, max_tokens: int) -> int:
        """The policy's `max_segment_tokens` under a micro-batch bound of `max_tokens`."""
        return max_tokens if self.max_segment_tokens is None else self.max_segment_tokens


@dataclass(frozen=True)
class LossConfig:
    """The loss of a step; `name` picks the aggregation, `correction` the off-policy
    correction (docs/training.md, "The objective"); "gyre" uses `max_paths_per_session`."""

    name: str = "grpo"
    correction: str = "none"
    clip_low: float = 0.2
    clip_high: float = 0.2
    max_importance_weight: float = 2.0
    dr_grpo_num_tokens: int = 4096
    max_paths_per_session: int = 2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    mis_low: float = 0.5
    mis_high: float = 5.0
    sequence_mask: str = "none"
    sequence_mask_low: float = 0.999
    sequence_mask_high: float = 1.001
    max_token_version_gap: int | None = None

    def __post_init__(self):
        if self.name not in LOSS_NAMES:
            raise LossConfigError(f"unknown loss {self.name!r}; choose one of {sorted(LOSS_NAMES)}")
        if self.correction not in CORRECTION_NAMES:
            raise LossConfigError(f"unknown off-policy correction {self.correction!r}; "
                                  f"choose one of {sorted(CORRECTION_NAMES)}")
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                raise LossConfigError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_importance_weight <= 0 or self.dr_grpo_num_tokens < 1:
            raise LossConfigError("LossConfig.max_importance_weight and dr_grpo_num_tokens "
                                  "must be positive")
        if self.max_paths_per_session < 1:
            raise LossConfigError(f"LossConfig.max_paths_per_session must be >= 1, "
                                  f"got {self.max_paths_per_session}")
        if self.sequence_mask not in SEQUENCE_MASKS:
            raise LossConfigError(f"unknown sequence mask {self.sequence_mask!r}; choose one "
                                  f"of {list(SEQUENCE_MASKS)}")
        gap = self.max_token_version_gap
        if gap is not None and (type(gap) is not int or gap < 0):
            raise LossConfigError(f"LossConfig.max_token_version_gap must be a number >= 0 "
                                  f"(0: only tokens of the weights trained) or null (off), "
                                  f"got {gap!r}")
        _check_band("mis", self.mis_low, self.mis_high)
        _check_band("sequence_mask", self.sequence_mask_low, self.sequence_mask_high)

    @property
    def paths_per_session(self) -> int | None:
        """What `pack_step` must be given as `max_paths_per_session`."""
        return self.max_paths_per_session if self.name == "gyre" else None


def _check_band(prefix: str, low: float, high: float) -> None:
    """A ratio band [low, high] must hold 1 (an on-policy token is never masked)."""
    if not 0 < low <= 1 <= high:
        raise LossConfigError(f"LossConfig.{prefix}_low and {prefix}_high must satisfy "
                              f"0 < low <= 1 <= high, got low={low}, high={high}")


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards become advantages: `scale` and `eps` (`group_advantages`),
    `timeout_reward` (`session_rewards`). `filter_uniform_groups`: DAPO's dynamic
    sampling, where the training loop drops a group whose valid sessions all got the
    same reward (every advantage 0, no signal) and launches a replacement, at most
    `max_extra_groups` extra groups a step (past that, such groups train as they are)."""

    scale: str = "std"
    eps: float = 1e-6
    timeout_reward: str = "partial_credit"
    filter_uniform_groups: bool = False
    max_extra_groups: int = 8

    def __post_init__(self):
        if self.max_extra_groups < 0:
            raise ValueError(f"AdvantageConfig.max_extra_groups must be >= 0, "
                             f"got {self.max_extra_groups}")
        if self.scale not in SCALES:
            raise ValueError(f"AdvantageConfig.scale must be one of {SCALES}, got {self.scale!r}")
        if self.timeout_reward not in TIMEOUT_REWARDS:
            raise ValueError(f"AdvantageConfig.timeout_reward must be one of {TIMEOUT_REWARDS}, "
                             f"got {self.timeout_reward!r}")
        if self.eps < 0:
            raise ValueError(f"AdvantageConfig.eps must be >= 0, got {self.eps}")


@dataclass(frozen=True)
class TrackerConfig:
    """The `logging` section of the run config. `dir` None: `RUN/trackers`; `run_name`
    empty: the run directory's name; `num_sample_sessions`: rows of each step's table."""

    trackers: tuple[str, ...] = ()
    dir: Path | None = None
    project: str = "undertow"
    run_name: str = ""
    wandb_mode: str = "offline"
    num_sample_sessions: int = 8

    def __post_init__(self) -> None:
        unknown = sorted(set(self.trackers) - set(TRACKERS))
        if unknown:
            raise ValueError(f"logging.trackers: unknown {unknown}; choose from {list(TRACKERS)}")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode must be one of {WANDB_MODES}, "
                             f"got {self.wandb_mode!r}")
        if self.num_sample_sessions < 0:
            raise ValueError(f"logging.num_sample_sessions must be >= 0, "
                             f"got {self.num_sample_sessions}")


@dataclass(frozen=True)
class SFTConfig:
    """`undertow sft`: cross-entropy on the trainable tokens of stored trees.

    Each epoch visits every group once, `groups_per_step` groups per optimiser step,
    in an order shuffled from `seed`; the loss is the mean over the step's trainable
    tokens (token mean), so long trajectories weigh by their tokens.
    """

    num_epochs: int = 1
    groups_per_step: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_tokens: int = 8192
    seed: int = 0
    dtype: str = "float32"
    min_reward: float | None = None
    frozen: tuple[str, ...] = ()  # as learner.frozen: not trained, no AdamW state

    def __post_init__(self) -> None:
        for name in ("num_epochs", "groups_per_step", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        _check_positive("sft", lr=self.lr, max_grad_norm=self.max_grad_norm)
        if self.weight_decay < 0:
            raise ValueError(f"sft.weight_decay must be >= 0, got {self.weight_decay}")
        if self.dtype not in DTYPES:
            raise ValueError(f"sft.dtype must be one of {DTYPES}, got {self.dtype!r}")


def torch_dtype(name: str):
    """The torch dtype named by a config's `dtype`."""
    import torch

    return {"float32": torch.float32, "float64": torch.float64,
            "bfloat16": torch.bfloat16}[name]
