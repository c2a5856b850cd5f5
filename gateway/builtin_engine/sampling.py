"""Sampling parameters (SGLang's `sampling_params` names and checks) and the batched sampler.

Semantics follow SGLang 0.5.x: `temperature` 0 means greedy; `top_k` -1 (or 0) disables top-k;
the logprob reported for a token is that of the temperature-scaled distribution before top-k,
top-p and min-p filtering (SGLang's default, without `SGLANG_RETURN_ORIGINAL_LOGPROB`).

Reproducibility: each request owns a `torch.Generator` seeded from `sampling_seed` (random when
absent) and draws exactly one uniform number per sampled token, then picks the token by inverse
CDF over its own row. So a seeded request samples the same tokens whether it runs alone or in
any batch.

Structured output (SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag`, at most one per
request) is enforced by `grammar.py` as a mask on the logits before `sample`; the reported logprob
is then that of the masked distribution, the one the token was drawn from.
"""

import random
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from undertow.gateway.builtin_engine.errors import BadRequest

GREEDY_EPS = 1e-6

# SGLang fields the engine accepts only at their neutral value.
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "n": 1,
            "logit_bias": None, "custom_params": None, "stop_regex": None}
_IGNORED = {"spaces_between_special_tokens", "stream_interval"}
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class RequestSampling:
    """Validated sampling parameters of one request, as the engine parsed them from its
    `sampling_params` (the server's side of the wire; the gateway's side is
    `engines.protocol.SamplingParams`)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    sampling_seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The structured-output constraint as (kind, text), or None."""
        for kind in CONSTRAINTS:
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def filters(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


_Number = TypeVar("_Number", int, float)


def _number(name: str, value, kind: type[_Number]) -> _Number:
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if not ok or isinstance(value, bool):
        raise BadRequest(f"sampling_params.{name} must be a {kind.__name__}, got {value!r}")
    return kind(value)


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"sampling_params.{name} must be true or false, got {value!r}")
    return value


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"sampling_params.stop must be a non-empty string or a list of them, "
                         f"got {value!r}")
    return tuple(stops)


def _stop_token_ids(value, vocab_size: int) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of token IDs in "
                         f"[0, {vocab_size}), got {value!r}")
    return frozenset(value)


def parse_sampling_params(raw, vocab_size: int) -> RequestSampling:
    """Validate a JSON `sampling_params` object; raise BadRequest naming the bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {raw!r}")
    known = set(RequestSampling.__dataclass_fields__)
    values = {}
    for name, value in raw.items():
        if name in _NEUTRAL:
            if value is not None and value != _NEUTRAL[name]:
                raise BadRequest(f"sampling_params.{name}={value!r} is not supported by the "
                                 f"built-in engine; leave it at {_NEUTRAL[name]!r}")
        elif name in _IGNORED or value is None:
            continue
        elif name not in known:
            raise BadRequest(f"sampling_params.{name} is unknown; known fields: {sorted(known)}")
        else:
            values[name] = value
    params = RequestSampling(
        max_new_tokens=_number("max_new_tokens", values.get("max_new_tokens", 128), int),
        min_new_tokens=_number("min_new_tokens", values.get("min_new_tokens", 0), int),
        temperature=_number("temperature", values.get("temperature", 1.0), float),
        top_p=_number("top_p", values.get("top_p", 1.0), float),
        top_k=_number("top_k", values.get("top_k", -1), int),
        min_p=_number("min_p", values.get("min_p", 0.0), float),
        stop=_stop(values.get("stop")),
        stop_token_ids=_stop_token_ids(values.get("stop_token_ids"), vocab_size),
        sampling_seed=(None if "sampling_seed" not in values
                       else _number("sampling_seed", values["sampling_seed"], int)),
        ignore_eos=_bool("ignore_eos", values.get("ignore_eos", False)),
        skip_special_tokens=_bool("skip_special_tokens", values.get("skip_special_tokens", True)),
        no_stop_trim=_bool("no_stop_trim", values.get("no_stop_trim", False)),
        **_constraint(values))
    _check_ranges(params)
    return params


def _constraint(values: dict) -> dict[str, str]:
    """At most one of SGLang's structured-output fields, each a non-empty string."""
    given = {kind: values[kind] for kind in CONSTRAINTS if values.get(kind) is not None}
    if len(given) > 1:
        raise BadRequest(f"sampling_params: give at most one of {list(CONSTRAINTS)}, "
                         f"got {sorted(given)}")
    for kind, text in given.items():
        if not isinstance(text, str) or not text:
            raise BadRequest(f"sampling_params.{kind} must be a non-empty string, got {text!r}")
    return given


def _check_ranges(p: RequestSampling) -> None:
    if p.max_new_tokens < 0:
        raise BadRequest(f"sampling_params.max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        raise BadRequest(f"sampling_params.min_new_tokens must be in [0, max_new_tokens], "
                         f"got {p.min_new_tokens}")
    if p.temperature < 0:
        raise BadRequest(f"sampling_params.temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        raise BadRequest(f"sampling_params.top_k must be -1 (disabled) or >= 1, got {p.top_k}")
    if not 0 <= p.min_p <= 1:
        raise BadRequest(f"sampling_params.min_p must be in [0, 1], got {p.min_p}")


def make_generator(params: RequestSampling) -> torch.Generator:
    seed = params.sampling_seed if params.sampling_seed is not None else random.getrandbits(62)
    return torch.Generator().manual_seed(seed)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]] | None  # per row, when any row asked


def sample(logits: torch.Tensor, params: list[RequestSampling], generators: list[torch.Generator],
           num_top_logprobs: int) -> SampleResult:
    """Pick one token per row of `logits` (B, V); report its logprob and the top-N."""
    temperatures = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):  # a (B, V) division costs ~1/3 of a step's sampling
        logits = logits / torch.tensor(temperatures).unsqueeze(1)
    logprobs = torch.log_softmax(logits, -1)
    chosen = logits.argmax(-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        probs = logprobs[rows].exp()
        draws = torch.cat([torch.rand(1, generator=generators[i]) for i in sampled_rows])
        # A row's pick must not depend on its batch: filtered rows always go through the
        # sorted path, unfiltered rows never do.
        filtered = torch.tensor([params[i].filters for i in sampled_rows])
        for group in (filtered, ~filtered):
            if group.any():
                group_params = [params[i] for i, f in zip(sampled_rows, group.tolist(),
                                                          strict=True) if f]
                chosen[rows[group]] = _inverse_cdf(probs[group], draws[group], group_params)
    token_ids = chosen.tolist()
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top = None
    if num_top_logprobs:
        values, indices = logprobs.topk(num_top_logprobs, -1)
        top = [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), indices.tolist(),
                                                             strict=True)]
    return SampleResult(token_ids=token_ids, logprobs=chosen_logprobs, top_logprobs=top)


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor,
                 params: list[RequestSampling]) -> torch.Tensor:
    """Token per row: the first whose cumulative (filtered) mass exceeds draw x total mass.
    Rows are all filtered or all unfiltered."""
    if not params[0].filters:
        cdf = probs.cumsum(-1)
        picks = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True)
        return picks.squeeze(1).clamp_(max=probs.shape[1] - 1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[1]).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else probs.shape[1] for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    before = sorted_probs.cumsum(-1) - sorted_probs
    drop = (ranks >= top_k.unsqueeze(1)) | (before > top_p.unsqueeze(1))
    drop |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    cdf = sorted_probs.cumsum(-1)
    picks = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(1), right=True)
    picks = picks.clamp_(max=probs.shape[1] - 1)
    return order.gather(1, picks).squeeze(1)
