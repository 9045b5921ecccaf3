"""TTT-MLP, bidirectional (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden
States", arXiv 2407.04620, used bidirectionally as ViT^3 uses TTT-Linear: see :mod:`mita.ops.ttt`).

The hidden state is an inner two-layer MLP per kv head, in the paper's TTT-MLP form with a residual
and a layer norm: f(x) = x + LN(GELU(x W1) W2), W1 (D x h), W2 (h x D), h = 4 D by default, exact
(erf) GELU, LN over the D channels with eps 1e-6. Simplifications, stated: no inner biases, no
learned affine in the LN, a fixed inner learning rate (no learned per-token rate). It is trained at
test time on the keys and values like TTT-Linear: per mini-batch of ``mini_batch_size`` consecutive
tokens, one gradient step on the mean reconstruction loss 1/2 ||f(k_j) - v_j||^2 of its real tokens
(padded tokens take no part), in order; then every query reads the final model: out_i = f_T(q_i).
One full-batch step (the default) is the bidirectional form: every token sees the model updated on
all of them.

The reference differentiates the inner loss by ``torch.autograd.grad`` (``create_graph=True``, so
the outer gradients reach q, k, v, W1 and W2 through the step). The registered path writes the
step's gradient out (the products of the backward by hand, the LN's and the GELU's elementwise
backwards by ATen's fused, differentiable kernels), so no graph of a graph is built. Both are
O(N D h), 14 N D h FLOPs per head with one step, and run equally fast on CPU (docs/zoo.md).
With inner_lr = 0 the output is the initial model applied to q.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import grouped_heads
from .kernelized import finish
from .ttt import check_ttt, inner_tensor, real_tokens

#: the inner layer norm's epsilon (Sun et al.'s)
LN_EPS = 1e-6


def default_inner_mlp(d: int, hidden: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's initial MLP without a layer: one fixed draw (seed 0), shared by the heads, W1 (1, 1, D, h) of
    std 1 / sqrt(D) and W2 (1, 1, h, D) of std 1 / sqrt(h), so that a call by name is deterministic."""
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(d, hidden, generator=gen, dtype=torch.float64) / math.sqrt(d)
    w2 = torch.randn(hidden, d, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
    return tuple(w.to(like.device, like.dtype)[None, None] for w in (w1, w2))


def _check(q, k, v, inner_lr, mini_batch_size, weight1, weight2, key_padding_mask, query_padding_mask, dropout_p):
    """Checked arguments, the learning rate, the mini-batch size, W1 (1, Hkv, D, h), W2 (1, Hkv, h, D), q, k, v."""
    cfg, lr, b, q32, k32, v32 = check_ttt(
        "TTT-MLP", q, k, v, inner_lr, mini_batch_size, key_padding_mask, query_padding_mask, dropout_p
    )
    Hkv, D = k.shape[1], k.shape[3]
    if (weight1 is None) != (weight2 is None):
        raise ValueError("weight1 and weight2 must be given together (or neither, for the default initial MLP)")
    if weight1 is None:
        w1, w2 = default_inner_mlp(D, 4 * D, k32)
        return cfg, lr, b, w1.expand(1, Hkv, -1, -1), w2.expand(1, Hkv, -1, -1), q32, k32, v32
    if not isinstance(weight1, torch.Tensor) or weight1.dim() == 0:
        raise TypeError(f"weight1 must be a float tensor of shape (Hkv={Hkv}, D={D}, h), got {weight1!r}")
    h = weight1.shape[-1]
    w1 = inner_tensor("weight1", weight1, (("Hkv", Hkv), ("D", D), ("h", h)), k32)
    w2 = inner_tensor("weight2", weight2, (("Hkv", Hkv), ("h", h), ("D", D)), k32)
    return cfg, lr, b, w1, w2, q32, k32, v32


def inner_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The inner model f(x) = x + LN(GELU(x W1) W2) on x (..., n, D) with W1 (..., D, h), W2 (..., h, D)."""
    return x + F.layer_norm(F.gelu(x @ w1) @ w2, x.shape[-1:], eps=LN_EPS)


def _read(q: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Every query through its kv head's final model: q (B, H, Nq, D), W1 and W2 (B, Hkv, ., .)."""
    B, H, Nq, D = q.shape
    return inner_mlp(grouped_heads(q, w1.shape[1]), w1.unsqueeze(2), w2.unsqueeze(2)).view(B, H, Nq, D)


def _batch_weights(real: torch.Tensor, start: int, b: int) -> torch.Tensor:
    """(B, 1, b, 1): 1 / n for each real token of the mini-batch (n its real tokens, at least 1), 0 if padded."""
    mask = real[:, start : start + b]
    return (mask / mask.sum(1, keepdim=True).clamp(min=1))[:, None, :, None]


def ttt_mlp_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    inner_lr: float = 0.1,
    mini_batch_size: int | None = None,
    weight1: torch.Tensor | None = None,
    weight2: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The inner step by autograd: ``torch.autograd.grad`` of the mean loss over a mini-batch's real tokens, with
    ``create_graph=True`` so that the outer gradients flow through it (it runs in no-grad mode too)."""
    cfg, lr, b, w1, w2, q32, k32, v32 = _check(
        q, k, v, inner_lr, mini_batch_size, weight1, weight2, key_padding_mask, query_padding_mask, dropout_p
    )
    outer = torch.is_grad_enabled()
    real = real_tokens(cfg, k32)
    with torch.enable_grad():
        w1, w2 = (w.expand(k.shape[0], -1, -1, -1) for w in (w1, w2))
        w1, w2 = (w if w.requires_grad else w.detach().requires_grad_() for w in (w1, w2))
        for start in range(0, k.shape[2], b):
            kt, vt = k32[:, :, start : start + b], v32[:, :, start : start + b]
            loss = 0.5 * ((inner_mlp(kt, w1, w2) - vt).square() * _batch_weights(real, start, b)).sum()
            g1, g2 = torch.autograd.grad(loss, (w1, w2), create_graph=outer)
            w1, w2 = w1 - lr * g1, w2 - lr * g2
        out = _read(q32, w1, w2)
    return finish(out if outer else out.detach(), cfg, q.dtype)


def _inner_step(
    w1: torch.Tensor, w2: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, weights: torch.Tensor, lr: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step W <- W - lr grad of sum_j weights_j 1/2 ||f(k_j) - v_j||^2, the gradient written out:
    E = weights (f(K) - V), dY = LN'(E), dZ = GELU'(Z) (dY W2^T), grad W2 = A^T dY, grad W1 = K^T dZ.
    The two elementwise backwards are ATen's fused (differentiable) kernels. kt, vt (B, Hkv, b, D), weights
    (B, 1, b, 1)."""
    z = kt @ w1
    a = F.gelu(z)
    y = a @ w2
    shape = [y.shape[-1]]
    normed, mean, rstd = torch.ops.aten.native_layer_norm(y, shape, None, None, LN_EPS)
    err = (kt + normed - vt) * weights  # d loss / d f(k), padded tokens zero
    dy = torch.ops.aten.native_layer_norm_backward(err, y, shape, mean, rstd, None, None, [True, False, False])[0]
    dz = torch.ops.aten.gelu_backward(dy @ w2.transpose(-1, -2), z)
    return w1 - lr * (kt.transpose(-1, -2) @ dz), w2 - lr * (a.transpose(-1, -2) @ dy)


def ttt_mlp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    inner_lr: float = 0.1,
    mini_batch_size: int | None = None,
    weight1: torch.Tensor | None = None,
    weight2: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Bidirectional TTT-MLP on (B, H, N, D) tensors in O(N D h), the inner gradient written out.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        inner_lr (float): the inner learning rate, >= 0. Default: 0.1 (Sun et al.'s base rate for TTT-MLP).
        mini_batch_size (int | None): keys per inner step; None takes all Nk (one full-batch step). Default: None.
        weight1 (torch.Tensor | None): the initial W1, broadcastable to (Hkv, D, h); h is its last dim.
            None (with ``weight2`` None) is a fixed random draw with h = 4 D (:func:`default_inner_mlp`).
            Default: None.
        weight2 (torch.Tensor | None): the initial W2, broadcastable to (Hkv, h, D). Default: None.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, lr, b, w1, w2, q32, k32, v32 = _check(
        q, k, v, inner_lr, mini_batch_size, weight1, weight2, key_padding_mask, query_padding_mask, dropout_p
    )
    real = real_tokens(cfg, k32)
    for start in range(0, k.shape[2], b):
        kt, vt = k32[:, :, start : start + b], v32[:, :, start : start + b]
        w1, w2 = _inner_step(w1, w2, kt, vt, _batch_weights(real, start, b), lr)
    return finish(_read(q32, w1.expand(k.shape[0], -1, -1, -1), w2.expand(k.shape[0], -1, -1, -1)), cfg, q.dtype)


def ttt_mlp_flops(n: int, d: int, **_: object) -> float:
    """Per token and step: K W1, A W2, the two weight gradients and dY W2^T (2 D h each, 10 N D h); every
    query through the MLP (4 N D h); h = 4 D: 56 N D^2."""
    return 14 * n * d * (4 * d)
