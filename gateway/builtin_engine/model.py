"""The forward pass of a dense decoder (Llama, Qwen2, Qwen3) in plain torch, on a KV buffer
with one slot per running request (`SlotKV`).

Loads `config.json` + `*.safetensors` of a Hugging Face directory (what differs between the
families, and what is refused, is read in `model_config.py`): RMSNorm, rotary embeddings
(rotate-half layout, Llama 3.x frequency scaling), grouped-query attention with the family's
q/k/v/o biases and, for Qwen3, per-head q/k RMSNorm, SwiGLU MLP, tied or separate output
embeddings. Why the weights are fused and packed, how the KV slots are laid out and why a row
batched gives what it gives alone: docs/engines.md, "The built-in engine".
"""

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from undertow.gateway.builtin_engine.errors import WeightLoadError
from undertow.gateway.builtin_engine.model_config import ModelConfig

MIN_ROWS = 8  # float32 GEMMs of fewer rows pick another kernel (another summation order)
TOKEN_ALIGN = 256
DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FINGERPRINT_ROWS = 4


def packs_linears(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether linear weights are packed for oneDNN (`pack_linear`): on the CPU when torch
    has it, which it has on x86 and ARM builds."""
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in DTYPES.values())


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) reordered into oneDNN's blocked layout for `linear`. On the CPU this
    takes a decode step's linears from MKL's GEMV-like kernels to oneDNN's packed GEMM: 2.1x
    (M=1) and 1.4x (M=32) less time for Qwen2.5-0.5B's bf16 layers here, 1.3-2.3x in
    float32. The packing (its block sizes) is chosen for MIN_ROWS rows; any row count runs."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), MIN_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`residual + F.linear(x, weight, bias)` (without the sum when `residual` is None); for a
    weight packed by `pack_linear`, oneDNN's linear, which adds `residual` inside the GEMM."""
    if not weight.is_mkldnn:
        out = F.linear(x, weight, bias)
        return out if residual is None else residual + out
    x = x.contiguous()  # oneDNN refuses strided inputs (.contiguous() is free when it is)
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), weight, bias,
                                                     "add")


def gated(x: torch.Tensor, layer: "LayerWeights") -> torch.Tensor:
    """SwiGLU's `silu(x gate^T) * (x up^T)` (with their biases); for packed weights, oneDNN
    applies the SiLU and the product inside the two GEMMs, so no (n, I) temporary is read
    back: at Qwen2.5-0.5B's 2,000-token prefill those were 39 MB each, four per layer."""
    if not layer.gate.is_mkldnn:
        return F.silu(F.linear(x, layer.gate, layer.gate_bias)) * F.linear(x, layer.up,
                                                                          layer.up_bias)
    x = x.contiguous()
    gate = torch.ops.mkldnn._linear_pointwise(x, layer.gate, layer.gate_bias, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, layer.up, layer.up_bias, "mul")


def resolve_device(name: str) -> torch.device:
    """The device `EngineConfig.device` names: "auto" is CUDA when torch sees a GPU, else
    the CPU."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WeightLoadError(f"device 'cuda' was asked for, but this torch ({torch.__version__}) "
                              "sees no CUDA device; use device=auto or device=cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weights' and KV's dtype: "auto" is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class LayerWeights:
    """One block's parameters, fused; a bias or norm the family lacks is None, which
    `F.linear` and `_qkv` take at no cost."""

    input_norm: torch.Tensor                # (D,)
    qkv: torch.Tensor                       # ((H + 2 KVH) hd, D)
    qkv_bias: torch.Tensor | None           # ((H + 2 KVH) hd,)
    qk_norm: torch.Tensor | None            # (H + KVH, hd): q_norm gains per q head, k_norm per kv
    o: torch.Tensor                         # (D, H hd)
    o_bias: torch.Tensor | None             # (D,)
    post_norm: torch.Tensor                 # (D,)
    gate: torch.Tensor                      # (I, D)
    gate_bias: torch.Tensor | None          # (I,)
    up: torch.Tensor                        # (I, D)
    up_bias: torch.Tensor | None            # (I,)
    down: torch.Tensor                      # (D, I)
    down_bias: torch.Tensor | None          # (D,)


@dataclass
class Weights:
    """All parameters of one model version; swapped as a whole, never edited in place.

    The linear weights (`LayerWeights.qkv`, `o`, `gate`, `up`, `down` and `lm_head`) may be packed
    for oneDNN (`pack_linear`: opaque tensors that only `linear` reads); `fingerprint` is
    computed from the weights as loaded, before packing (`undertow_kv.py` compares it)."""

    embed: torch.Tensor           # (V, D)
    layers: list[LayerWeights]
    norm: torch.Tensor            # (D,)
    lm_head: torch.Tensor         # (V, D)
    fingerprint: str


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir} holds no *.safetensors file; pass a model directory")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


class _Reader:
    """Takes named tensors of the expected shapes out of a model directory's files."""

    def __init__(self, model_dir: Path, device: torch.device | str, dtype: torch.dtype):
        self.model_dir, self.device, self.dtype = model_dir, device, dtype
        self.tensors = _read_tensors(model_dir)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise WeightLoadError(f"{self.model_dir}: tensor {name} is missing")
        tensor = self.tensors[name]
        if tuple(tensor.shape) != shape:
            raise WeightLoadError(
                f"{self.model_dir}: {name} has shape {tuple(tensor.shape)}, the served model "
                f"needs {shape}; load weights of the same architecture")
        return tensor.to(self.device, self.dtype)

    def fused(self, present: bool, parts: list[tuple[str, tuple[int, ...]]]
              ) -> torch.Tensor | None:
        """The named tensors concatenated along their first dimension, or None when the
        family has no such parameter."""
        return torch.cat([self.take(name, shape) for name, shape in parts]) if present else None


def _layer_weights(reader: _Reader, config: ModelConfig, index: int) -> LayerWeights:
    c, p = config, f"model.layers.{index}."
    d, hd, inner = c.hidden_size, c.head_dim, c.intermediate_size
    q_rows, kv_rows = c.num_heads * hd, c.num_kv_heads * hd
    projections = [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)]
    qk_norm = None
    if c.qk_norm:
        qk_norm = torch.cat([reader.take(p + "self_attn.q_norm.weight", (hd,)).expand(
            c.num_heads, hd), reader.take(p + "self_attn.k_norm.weight", (hd,)).expand(
            c.num_kv_heads, hd)])
    return LayerWeights(
        input_norm=reader.take(p + "input_layernorm.weight", (d,)),
        qkv=torch.cat([reader.take(f"{p}self_attn.{name}.weight", (rows, d))
                       for name, rows in projections]),
        qkv_bias=reader.fused(c.qkv_bias, [(f"{p}self_attn.{name}.bias", (rows,))
                                           for name, rows in projections]),
        qk_norm=qk_norm,
        o=reader.take(p + "self_attn.o_proj.weight", (d, q_rows)),
        o_bias=reader.fused(c.o_bias, [(p + "self_attn.o_proj.bias", (d,))]),
        post_norm=reader.take(p + "post_attention_layernorm.weight", (d,)),
        gate=reader.take(p + "mlp.gate_proj.weight", (inner, d)),
        gate_bias=reader.fused(c.mlp_bias, [(p + "mlp.gate_proj.bias", (inner,))]),
        up=reader.take(p + "mlp.up_proj.weight", (inner, d)),
        up_bias=reader.fused(c.mlp_bias, [(p + "mlp.up_proj.bias", (inner,))]),
        down=reader.take(p + "mlp.down_proj.weight", (d, inner)),
        down_bias=reader.fused(c.mlp_bias, [(p + "mlp.down_proj.bias", (d,))]))


def load_weights(model_dir: Path, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Weights:
    """Read and fuse the weights of `model_dir` onto `device` in `dtype`, packing the linear
    weights where `packs_linears`; WeightLoadError if they do not fit `config`."""
    reader = _Reader(model_dir, device, dtype)
    c = config
    layers = [_layer_weights(reader, c, index) for index in range(c.num_layers)]
    embed = reader.take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
    lm_head = (embed if c.tie_word_embeddings
               else reader.take("lm_head.weight", (c.vocab_size, c.hidden_size)))
    norm = reader.take("model.norm.weight", (c.hidden_size,))
    rows = FINGERPRINT_ROWS
    digest = fingerprint([norm, embed[:rows], layers[0].qkv[:rows], layers[-1].down[:rows],
                          lm_head[-rows:]])
    if packs_linears(device, dtype):
        for layer in layers:
            for name in ("qkv", "o", "gate", "up", "down"):
                setattr(layer, name, pack_linear(getattr(layer, name)))
        lm_head = pack_linear(lm_head)  # a tied head is packed apart from `embed`
    return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head, fingerprint=digest)


def fingerprint(tensors: list[torch.Tensor]) -> str:
    """A short digest of a few weight tensors (as loaded, before packing): equal for engines
    serving the same weights, different (with overwhelming probability) for other weights of
    the same shapes."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class SlotKV:
    """Keys and values of the running requests, one slot each: `k` and `v` of shape (layers,
    slots, kv_heads, max_tokens, head_dim), running requests in slots 0..B-1.

    Invariant: the first `length` positions of a slot hold its request's KV; slots grow by
    reallocation (to multiples of TOKEN_ALIGN tokens, doubling slots), so the memory held is
    about (running requests) x (longest running request), and is released when all leave.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.k = self.v = torch.empty(0, device=self.device, dtype=dtype)
        self.num_slots = self.max_tokens = 0

    def reserve(self, num_slots: int, max_tokens: int) -> None:
        """Make room for `num_slots` slots of `max_tokens` tokens, keeping what is stored."""
        if num_slots <= self.num_slots and max_tokens <= self.max_tokens:
            return
        new_slots = max(self.num_slots, 1)
        while new_slots < num_slots:
            new_slots *= 2
        new_tokens = max(self.max_tokens, -(-max_tokens // TOKEN_ALIGN) * TOKEN_ALIGN)
        if new_tokens < max_tokens * 5 // 4:
            new_tokens = -(-(max_tokens * 3 // 2) // TOKEN_ALIGN) * TOKEN_ALIGN
        c = self.config
        shape = (c.num_layers, new_slots, c.num_kv_heads, new_tokens, c.head_dim)
        k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        v = torch.zeros(shape, device=self.device, dtype=self.dtype)
        if self.num_slots:
            k[:, :self.num_slots, :, :self.max_tokens] = self.k
            v[:, :self.num_slots, :, :self.max_tokens] = self.v
        self.k, self.v = k, v
        self.num_slots, self.max_tokens = new_slots, new_tokens

    def release(self) -> None:
        self.k = self.v = torch.empty(0, device=self.device, dtype=self.dtype)
        self.num_slots = self.max_tokens = 0

    def move(self, source: int, target: int, length: int) -> None:
        self.k[:, target, :, :length] = self.k[:, source, :, :length]
        self.v[:, target, :, :length] = self.v[:, source, :, :length]

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """KV of positions [start, end) as one (layers, 2, kv_heads, tokens, head_dim) tensor."""
        return torch.stack([self.k[:, slot, :, start:end], self.v[:, slot, :, start:end]], 1)

    def write(self, slot: int, start: int, kv: torch.Tensor) -> None:
        end = start + kv.shape[3]
        kv = kv.to(self.device, self.dtype)
        self.k[:, slot, :, start:end] = kv[:, 0]
        self.v[:, slot, :, start:end] = kv[:, 1]


@dataclass(frozen=True)
class PrefillSpan:
    """One request's part in `CausalLM.prefill_many`: `token_ids` at positions start.. in KV
    slot `slot`, whose first `start` positions hold the prefix's KV; the logits of its rows
    `logit_rows` (a slice of its own rows) are wanted."""

    slot: int
    token_ids: list[int]
    start: int
    logit_rows: slice


class CausalLM:
    """The forward pass of a Llama, Qwen2 or Qwen3 decoder (`model_config.py`). `weights` may
    be replaced between calls (weight updates) by weights on the same device in the same
    dtype, which are the model's."""

    def __init__(self, config: ModelConfig, weights: Weights):
        self.config = config
        self.weights = weights
        self.device, self.dtype = weights.embed.device, weights.embed.dtype
        # bfloat16 promises no batched-equals-alone identity (docs/engines.md), so it does
        # not pay for the padding: at one row, 8 cost 1.4x the time of 1 in its linears.
        self.min_rows = MIN_ROWS if self.dtype == torch.float32 else 1
        self.inv_freq = torch.tensor(config.rope.frequencies(config.head_dim),
                                     dtype=torch.float64)
        self.cos = self.sin = torch.empty(0, config.head_dim)

    def reserve_positions(self, num_positions: int) -> None:
        """Have the rotary tables cover positions 0..num_positions-1 (grown in 1024s), so
        that no step has to extend them (a KV import calls it before its request runs)."""
        if num_positions > self.cos.shape[0]:
            count = -(-num_positions // 1024) * 1024
            freqs = torch.outer(torch.arange(count, dtype=torch.float64), self.inv_freq)
            self.cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(self.device, self.dtype)
            self.sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(self.device, self.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, each (n, 1, head_dim), for rotate-half RoPE."""
        self.reserve_positions(int(positions.max()) + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, cos, sin):
        """Rotated (and, for Qwen3, normed) q (n, H, hd) and k (n, KVH, hd), and v."""
        c = self.config
        n, hd = x.shape[0], c.head_dim
        h = F.rms_norm(x, (c.hidden_size,), layer.input_norm, c.rms_norm_eps)
        qkv = linear(h, layer.qkv, layer.qkv_bias)
        qk = qkv[:, :(c.num_heads + c.num_kv_heads) * hd].view(n, -1, hd)
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, c.rms_norm_eps) * layer.qk_norm
        qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
        v = qkv[:, (c.num_heads + c.num_kv_heads) * hd:].view(n, c.num_kv_heads, hd)
        return qk[:, :c.num_heads], qk[:, c.num_heads:], v

    def _finish_layer(self, layer: LayerWeights, x, attn: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = linear(attn, layer.o, layer.o_bias, residual=x)
        h = F.rms_norm(x, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
        return linear(gated(h, layer), layer.down, layer.down_bias, residual=x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, V) float32 logits on the CPU, where sampling and the logprobs are made."""
        c = self.config
        h = F.rms_norm(hidden, (c.hidden_size,), self.weights.norm, c.rms_norm_eps)
        return linear(h, self.weights.lm_head, None).to("cpu", torch.float32)

    @torch.inference_mode()
    def prefill(self, kv: SlotKV, slot: int, token_ids: list[int], start: int,
                logit_rows: slice) -> torch.Tensor:
        """Run `token_ids` at positions start.. in `slot` (whose first `start` positions hold the
        prefix's KV), store their KV, and return the logits of rows `logit_rows` (n, V)."""
        return self.prefill_many(kv, [PrefillSpan(slot, token_ids, start, logit_rows)])[0]

    @torch.inference_mode()
    def prefill_many(self, kv: SlotKV, spans: list["PrefillSpan"]) -> list[torch.Tensor]:
        """Prefill several requests' spans in one pass: their rows go through each linear
        layer together (one call per layer for all, where the weights are read once), and
        each span attends to its own slot; return each span's logits of its `logit_rows`."""
        counts = [len(span.token_ids) for span in spans]
        n = sum(counts)
        rows = max(n, self.min_rows)
        device = self.device
        ids = torch.tensor([t for span in spans for t in span.token_ids] + [0] * (rows - n),
                           device=device)
        positions = torch.cat([torch.arange(span.start, span.start + count, device=device)
                               for span, count in zip(spans, counts, strict=True)]
                              + [torch.zeros(rows - n, dtype=torch.long, device=device)])
        cos, sin = self._rope(positions)
        bounds = [(offset - count, offset) for count, offset
                  in zip(counts, itertools.accumulate(counts), strict=True)]
        masks = [self._prefix_mask(span, count) for span, count in zip(spans, counts,
                                                                          strict=True)]
        pad = None if rows == n else torch.zeros(
            rows - n, self.config.num_heads * self.config.head_dim, device=device,
            dtype=self.dtype)
        x = self.weights.embed[ids]
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            parts = [self._attend_span(kv, index, span, mask, q[a:b], k[a:b], v[a:b])
                     for span, mask, (a, b) in zip(spans, masks, bounds, strict=True)]
            attn = parts[0] if len(parts) == 1 and pad is None else torch.cat(
                parts + ([] if pad is None else [pad]))
            x = self._finish_layer(layer, x, attn)
        wanted = [x[a:b][span.logit_rows] for span, (a, b) in zip(spans, bounds, strict=True)]
        logits = self.logits(torch.cat(wanted))
        return list(logits.split([len(rows) for rows in wanted]))

    def _prefix_mask(self, span: "PrefillSpan", count: int) -> torch.Tensor | None:
        """None for a span from position 0 (SDPA's causal kernel), else the (count, start +
        count) mask of which keys each of its rows may see."""
        if not span.start:
            return None
        end = span.start + count
        return (torch.arange(end, device=self.device).unsqueeze(0)
                <= torch.arange(span.start, end, device=self.device).unsqueeze(1))

    def _attend_span(self, kv: SlotKV, index: int, span: "PrefillSpan", mask, q, k, v):
        """Store a span's keys and values of layer `index` in its slot; its attention output
        (n, H hd) over the slot's first start + n positions."""
        n, slot = q.shape[0], span.slot
        end = span.start + n
        kv.k[index, slot, :, span.start:end] = k.transpose(0, 1)
        kv.v[index, slot, :, span.start:end] = v.transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), kv.k[index, slot:slot + 1, :, :end],
            kv.v[index, slot:slot + 1, :, :end], attn_mask=mask, is_causal=mask is None,
            enable_gqa=True)
        return attn[0].transpose(0, 1).reshape(n, -1)

    @torch.inference_mode()
    def decode(self, kv: SlotKV, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One step for the requests in slots 0..B-1 (token b at positions[b]); (B, V) logits."""
        c = self.config
        num_rows = len(token_ids)
        rows = max(num_rows, self.min_rows)
        device, dtype = self.device, self.dtype
        ids = torch.tensor(token_ids + [0] * (rows - num_rows), device=device)
        position_tensor = torch.tensor(positions + [0] * (rows - num_rows), device=device)
        cos, sin = self._rope(position_tensor)
        slots = torch.arange(num_rows, device=device)
        row_positions = position_tensor[:num_rows]
        num_keys = max(positions) + 1
        # (B KVH, 1, T): 0 for a row's own keys, -inf past its length (exactly zero weight).
        # Scores, softmax and the weighted sum are float32 whatever the KV's dtype, as SDPA
        # keeps them: in bfloat16 they doubled attention's error (0.0046 vs 0.0023 mean).
        mask = torch.zeros(num_rows, num_keys, device=device).masked_fill_(
            torch.arange(num_keys, device=device).unsqueeze(0) > row_positions.unsqueeze(1),
            float("-inf"))
        mask = mask.repeat_interleave(c.num_kv_heads, 0).unsqueeze(1)
        group = c.num_heads // c.num_kv_heads
        scale = c.head_dim ** -0.5
        pad = None if rows == num_rows else torch.zeros(
            rows - num_rows, c.num_heads * c.head_dim, device=device, dtype=dtype)
        x = self.weights.embed[ids]
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            layer_k, layer_v = kv.k[index], kv.v[index]
            layer_k[slots, :, row_positions] = k[:num_rows]
            layer_v[slots, :, row_positions] = v[:num_rows]
            keys, values = _gathered(layer_k, num_rows, num_keys), _gathered(
                layer_v, num_rows, num_keys)
            q = q[:num_rows].float().reshape(num_rows * c.num_kv_heads, group, c.head_dim)
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=scale)
            attn = torch.bmm(torch.softmax(scores, -1), values).view(num_rows, -1).to(dtype)
            if pad is not None:
                attn = torch.cat([attn, pad])
            x = self._finish_layer(layer, x, attn)
        return self.logits(x[:num_rows])


def _gathered(layer_kv: torch.Tensor, num_rows: int, num_keys: int) -> torch.Tensor:
    """The first `num_keys` positions of slots 0..num_rows-1 of one layer's keys or values
    (slots, KVH, max_tokens, hd) as one contiguous float32 (B KVH, T, hd) tensor: one copy,
    which the strided slice needs anyway."""
    _, num_kv_heads, _, head_dim = layer_kv.shape
    out = torch.empty(num_rows, num_kv_heads, num_keys, head_dim, device=layer_kv.device)
    out.copy_(layer_kv[:num_rows, :, :num_keys])
    return out.view(num_rows * num_kv_heads, num_keys, head_dim)
