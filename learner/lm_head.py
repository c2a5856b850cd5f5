"""The LM head applied in chunks of positions: logprobs and entropy without (N, V) tensors.
`PolicyModel` scores N positions against a vocabulary of V tokens; the whole head at once
keeps several (N, V) tensors alive for the backward (logits, log-probs, their exp), 12 GB
each at N = 20k, V = 150k. `chunked_scores` keeps at most one chunk's logits and their
gradient alive, forward or backward; `head_scores` is the unchunked reference.
"""

from __future__ import annotations

import torch
from torch import nn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ScoringHead(nn.Module):
    """An LM head whose forward returns (N,) logprobs and entropies (or None), not logits.

    It takes over an `nn.Linear` head's weight (and bias) as its own parameters, under the
    same names, so a model's `named_parameters` do not change when its head is replaced.
    `chunk_tokens` 0 applies the head to all rows at once (`head_scores`). A sharded
    model's own (untied) head is one: FSDP2 gathers a unit's weight before the unit's
    forward and reduce-scatters its gradient after that forward's backward, and the
    scores never call `nn.Linear.forward`, so this forward computes the scores.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight                                     # (V, H)
        self.bias = linear.bias                                         # (V,) or None

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if chunk_tokens:
            return _chunked(self.weight, self.bias, hidden, targets, with_entropy, chunk_tokens)
        return _unchunked(self.weight, self.bias, hidden, targets, with_entropy)


def head_scores(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unchunked reference: (N,) logprobs and entropies from the full (N, V) logits."""
    if isinstance(head, ScoringHead):
        return head(hidden, targets, with_entropy, 0)
    return _unchunked(head.weight, head.bias, hidden, targets, with_entropy)


def _unchunked(weight, bias, hidden, targets, with_entropy):
    logits = torch.nn.functional.linear(hidden, weight, bias)           # (N, V)
    log_probs = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1)
    logprobs = log_probs.gather(-1, targets[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return logprobs, entropy


def chunked_scores(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                   with_entropy: bool, chunk_tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N,) logprobs of `targets` and (N,) entropies (or None) at the rows of `hidden`
    (N, H), the head (an `nn.Linear` or a `ScoringHead`) applied `chunk_tokens` rows at
    a time: the forward keeps only (N,) results and the log-sum-exp, and the backward
    recomputes each chunk's logits and turns them into the gradient at once. The logits
    are taken in the model's dtype and the softmax in float32 for half and bfloat16
    models, as `head_scores` does."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if isinstance(head, ScoringHead):
        return head(hidden, targets, with_entropy, chunk_tokens)
    return _chunked(head.weight, head.bias, hidden, targets, with_entropy, chunk_tokens)


def _chunked(weight, bias, hidden, targets, with_entropy, chunk_tokens):
    logprobs, entropy = _ChunkedHead.apply(hidden, weight, bias, targets,
                                           chunk_tokens, with_entropy)
    return logprobs, entropy if with_entropy else None


def _chunk_logits(hidden, weight, bias, rows: slice) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden[rows], weight, bias)     # (n, V)
    return logits.to(_compute_dtype(logits.dtype))


class _ChunkedHead(torch.autograd.Function):
    """Saves hidden (N, H), the head's weight, the targets, lse (N,) and entropy (N,):
    no tensor with a vocabulary dimension outlives one chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, with_entropy: bool):
        num_rows = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        logprobs = torch.empty(num_rows, dtype=dtype, device=hidden.device)
        entropy = torch.zeros(num_rows, dtype=dtype, device=hidden.device)
        lse = torch.empty(num_rows, dtype=dtype, device=hidden.device)
        for start in range(0, num_rows, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden, weight, bias, rows)          # (n, V)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            logprobs[rows] = logits.gather(-1, targets[rows, None])[:, 0] - lse[rows]
            if with_entropy:
                log_probs = logits.sub_(lse[rows, None])                # in place: (n, V)
                entropy[rows] = -(log_probs.exp() * log_probs).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk_tokens, ctx.with_entropy = chunk_tokens, with_entropy
        ctx.set_materialize_grads(False)    # an unused output's gradient comes as None
        return logprobs, entropy

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_logprobs, grad_entropy = grad_outputs
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = (torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2]
                     else None)
        if grad_entropy is not None and not ctx.with_entropy:
            grad_entropy = None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            log_probs = _chunk_logits(hidden, weight, bias, rows).sub_(lse[rows, None])
            probs = log_probs.exp()                                     # (n, V)
            grad_logits = _logits_grad(log_probs, probs, targets[rows], entropy[rows],
                                       None if grad_logprobs is None else grad_logprobs[rows],
                                       None if grad_entropy is None else grad_entropy[rows])
            del log_probs, probs
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[rows]
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits_grad(log_probs, probs, targets, entropy, grad_logprobs, grad_entropy):
    """(n, V) gradient at the logits from the (n,) gradients at logprobs and entropy;
    overwrites `probs` and `log_probs`. Per position with logits z, p = softmax(z),
    target y, l = z_y - lse(z) and H = -sum_j p_j log p_j:
    dl/dz = onehot(y) - p, dH/dz = -p * (log p + H)."""
    grad = torch.zeros_like(probs) if grad_logprobs is None else probs.mul(-grad_logprobs[:, None])
    if grad_logprobs is not None:
        grad.scatter_add_(-1, targets[:, None], grad_logprobs[:, None].to(grad.dtype))
    if grad_entropy is not None:
        grad -= probs.mul_(log_probs.add_(entropy[:, None])).mul_(grad_entropy[:, None])
    return grad
