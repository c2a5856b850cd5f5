"""What the built-in forward needs from a model directory's `config.json`, and which
configurations it refuses.

Three dense decoder families share one forward (`model.py`): pre-norm RMSNorm blocks,
grouped-query attention with rotate-half rotary embeddings, a SwiGLU MLP, tied or separate
output embeddings. They differ only in what `FAMILY_RULES` lists:

- `llama` (SmolLM, Llama 2/3.x): biases on q/k/v/o when `attention_bias`, on the MLP when
  `mlp_bias`; Llama 3.x scales the rotary frequencies (`rope_type: llama3`).
- `qwen2` (Qwen2, Qwen2.5, Qwen2.5-Coder): q/k/v always carry a bias, o and the MLP never.
- `qwen3`: per-head RMSNorm on q and k; biases on q/k/v/o when `attention_bias`.

Anything else the forward would run wrongly is refused by `ModelConfig.from_dir` with a
`WeightLoadError` naming the field: another `model_type` (MoE, sliding-window and
multimodal families), sliding-window layers, experts, a rope type other than `default`
and `llama3`, partial rotary embeddings, an activation other than SiLU. Both the
transformers 5 form (`rope_parameters` holding `rope_theta`) and the older one
(`rope_theta` and `rope_scaling` at the top) are read.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from undertow.gateway.builtin_engine.errors import WeightLoadError

ROPE_TYPES = ("default", "llama3")
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class FamilyRule:
    """Which optional parts a family has; None means "as `attention_bias` says"."""

    qk_norm: bool
    qkv_bias: bool | None
    o_bias: bool | None
    reads_mlp_bias: bool


FAMILY_RULES = {
    "llama": FamilyRule(qk_norm=False, qkv_bias=None, o_bias=None, reads_mlp_bias=True),
    "qwen2": FamilyRule(qk_norm=False, qkv_bias=True, o_bias=False, reads_mlp_bias=False),
    "qwen3": FamilyRule(qk_norm=True, qkv_bias=None, o_bias=None, reads_mlp_bias=False),
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embeddings: `theta` and, for `kind` "llama3", Llama 3.x's frequency scaling
    (long wavelengths divided by `factor`, a smooth blend between `low_freq_factor` and
    `high_freq_factor` of the original context)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def frequencies(self, head_dim: int) -> list[float]:
        """The inverse frequency of each of the head's `head_dim // 2` rotation pairs."""
        half = head_dim // 2
        base = [self.theta ** (-index / half) for index in range(half)]
        if self.kind == "default":
            return base
        low_wavelength = self.original_max_positions / self.low_freq_factor
        high_wavelength = self.original_max_positions / self.high_freq_factor
        scaled = []
        for frequency in base:
            wavelength = 2 * math.pi / frequency
            if wavelength < high_wavelength:
                scaled.append(frequency)
            elif wavelength > low_wavelength:
                scaled.append(frequency / self.factor)
            else:
                smooth = ((self.original_max_positions / wavelength - self.low_freq_factor)
                          / (self.high_freq_factor - self.low_freq_factor))
                scaled.append((1 - smooth) * frequency / self.factor + smooth * frequency)
        return scaled


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a Llama, Qwen2 or Qwen3 `config.json` the forward pass needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise WeightLoadError(f"{path} is missing; pass a Hugging Face model directory")
        return cls.from_json(json.loads(path.read_text()), str(path))

    @classmethod
    def from_json(cls, raw: dict, source: str) -> "ModelConfig":
        """The config of `raw` (the parsed `config.json` at `source`, named in errors)."""
        rule = _family_rule(raw, source)
        _refuse_unsupported(raw, source)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        num_heads = raw["num_attention_heads"]
        return cls(
            model_type=raw["model_type"], vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope=_rope(raw, source),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            qk_norm=rule.qk_norm,
            qkv_bias=attention_bias if rule.qkv_bias is None else rule.qkv_bias,
            o_bias=attention_bias if rule.o_bias is None else rule.o_bias,
            mlp_bias=rule.reads_mlp_bias and bool(raw.get("mlp_bias", False)))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


def _family_rule(raw: dict, source: str) -> FamilyRule:
    model_type = raw.get("model_type")
    if model_type not in FAMILY_RULES:
        raise WeightLoadError(
            f"{source}: model_type {model_type!r} is not served; the built-in engine runs "
            f"dense decoders of the families {sorted(FAMILY_RULES)} (serve other models "
            "with engine=vllm or engine=sglang)")
    return FAMILY_RULES[model_type]


def _refuse_unsupported(raw: dict, source: str) -> None:
    """WeightLoadError naming the first field that asks for what the forward lacks."""
    if raw.get("use_sliding_window"):
        raise WeightLoadError(f"{source}: use_sliding_window is true; the built-in engine "
                              "attends over the full context only")
    layer_types = set(raw.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise WeightLoadError(f"{source}: layer_types holds {sorted(layer_types)}; the "
                              "built-in engine runs full_attention layers only")
    for name in EXPERT_FIELDS:
        if raw.get(name):
            raise WeightLoadError(f"{source}: {name} is {raw[name]}; the built-in engine "
                                  "runs dense models only (no mixture of experts)")
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise WeightLoadError(f"{source}: hidden_act {activation!r} is not supported; the "
                              "built-in engine's MLP is SwiGLU (silu)")


def _rope(raw: dict, source: str) -> RopeConfig:
    """The rotary config from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (older files)."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    if any(isinstance(value, dict) for value in params.values()):
        raise WeightLoadError(f"{source}: rope_parameters per layer type are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise WeightLoadError(f"{source}: rope_type {kind!r} is not supported; the built-in "
                              f"engine implements {list(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise WeightLoadError(f"{source}: partial_rotary_factor {partial} is not supported; "
                              "the built-in engine rotates the whole head")
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    if kind == "default":
        return RopeConfig(theta)
    try:
        return RopeConfig(theta, kind, float(params["factor"]), float(params["low_freq_factor"]),
                          float(params["high_freq_factor"]),
                          int(params["original_max_position_embeddings"]))
    except KeyError as missing:
        raise WeightLoadError(f"{source}: rope_type llama3 needs {missing.args[0]} in "
                              "rope_parameters (or rope_scaling)") from None
