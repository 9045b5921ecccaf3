"""Injective linear attention (Han, Wang, Xia, Han, Chen, Song and Huang, "Bridging the Divide:
Reconsidering Softmax and Linear Attention", NeurIPS 2024).

Linear attention normalised by division maps queries that differ only in scale to the same
attention weights (it is not injective). InLine normalises by subtraction instead: over the
n real keys, the weights are w_ij = 1/n + s (q_i . k_j - mean_l q_i . k_l) / n, which sum to 1
in every row without a division, so the output is
out_i = mean(V) + (s / n) q_i (K^T V) - s (q_i . mean(K)) mean(V), in O(N D^2). The kernel is
the identity (phi(x) = x) and s = D^-1/2, as in the authors' DeiT code. One shared linear
expert built by kernelization (spec section 5). The reference forms the weight matrix. The
paper's local residual (a 3x3 depth-wise convolution on V whose kernels are predicted from
the mean token) belongs to the layer, :class:`mita.layers.kernelized.InLineAttention`.
"""

from __future__ import annotations

import torch

from .common import grouped_heads
from .kernelized import check_linear, finish, real_key_count


def inline_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The weights written out: W = 1/n + s (Q K^T - row means) / n over the real keys, out = W V."""
    cfg, q32, k32, v32 = check_linear(
        "InLine attention", q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale
    )
    G = q.shape[1] // k.shape[1]
    k32, v32 = k32.repeat_interleave(G, dim=1), v32.repeat_interleave(G, dim=1)
    n = real_key_count(cfg, k32)
    real = torch.ones(k.shape[0], 1, 1, k.shape[2], dtype=torch.bool, device=k.device)
    if cfg.key_mask is not None:
        real = cfg.key_mask[:, None, None, :]
    scores = q32 @ k32.transpose(-1, -2)  # padded keys score 0 (their rows of K are zero)
    centred = scores - scores.sum(-1, keepdim=True) / n
    weights = ((1 + cfg.scale * centred) / n).masked_fill(~real, 0)
    return finish(weights @ v32, cfg, q.dtype)


def inline_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """InLine attention on (B, H, N, D) tensors in O(N D^2).

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        scale (float | None): s, positive and finite. Default: D**-0.5.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, q32, k32, v32 = check_linear(
        "InLine attention", q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale
    )
    B, H, Nq, D = q.shape
    Hkv = k.shape[1]
    n = real_key_count(cfg, k32)  # (B, 1, 1, 1)
    qg = grouped_heads(q32, Hkv)
    k_mean, v_mean = (t.sum(2, keepdim=True).unsqueeze(2) / n[..., None] for t in (k32, v32))  # (B, Hkv, 1, 1, D)
    state = (k32.transpose(-1, -2) @ v32 / n).unsqueeze(2)  # (B, Hkv, 1, D, D)
    out = cfg.scale * (qg @ state) + (1 - cfg.scale * (qg @ k_mean.transpose(-1, -2))) * v_mean
    return finish(out.view(B, H, Nq, D), cfg, q.dtype)


def inline_flops(n: int, d: int, **_: object) -> float:
    """K^T V and Q times it (2 N D^2 each), q . mean(K) and the mean-value term (4 N D)."""
    return 4 * n * d * d + 4 * n * d
