"""Polarity-aware linear attention (Meng, Luo, Li, Jiang and Zhang, "PolaFormer: Polarity-aware Linear
Attention for Vision Transformers", ICLR 2025).

q and k (divided by a learned per-channel scale s > 0) are split into their positive and
negative parts, x+ = ReLU(x) and x- = ReLU(-x), each raised to a learned per-channel power
p >= 1 (the paper's learnable power function, p = 1 + 4 sigmoid(theta), 3 at initialisation,
in the layer). q . k = q+ . k+ + q- . k- - q+ . k- - q- . k+: the same-sign interactions
use the features [q+, q-] against [k+, k-], the opposite-sign ones [q-, q+] against [k+, k-].
Each stream is a normalised linear attention over its own half of the value channels (the
paper's sign-aware matrices G^s and G^o, realised as in the authors' code by a fixed split
of V's channels whose contents the value projection learns), and the two halves are
concatenated: out = [O^s, O^o], with O = (phi(q) . phi(K)^T V / n) / (phi(q) . mean phi(K) + 1e-6)
over the n real keys, the authors' constants. One shared linear expert built by
kernelization (spec section 5). The depth-wise convolution on V of the authors' full model
is a layer option (:class:`mita.layers.kernelized.PolaAttention`), off by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernelized import (
    check_linear,
    finish,
    for_queries,
    head_tensor,
    mask_features,
    normalised_linear,
    normalised_linear_reference,
    real_key_count,
)

#: the authors' constant in the normaliser
EPS = 1e-6


def _features(q, k, v, power, feature_scale, key_padding_mask, query_padding_mask, dropout_p):
    """Checked arguments, the same-sign and opposite-sign query features, the key features, v and n."""
    cfg, q, k, v = check_linear(
        "polarity-aware linear attention", q, k, v, key_padding_mask, query_padding_mask, dropout_p
    )
    p = head_tensor("power", power, k, low=1.0, closed=True)
    s = head_tensor("feature_scale", 1.0 if feature_scale is None else feature_scale, k)
    H = q.shape[1]
    q, k = q / for_queries(s, H), k / s
    p_q = for_queries(p, H)
    q_pos, q_neg = F.relu(q) ** p_q, F.relu(-q) ** p_q
    q_same, kf = mask_features(torch.cat([q_pos, q_neg], -1), torch.cat([F.relu(k) ** p, F.relu(-k) ** p], -1), cfg)
    q_opposite = torch.cat([q_neg, q_pos], -1)  # padded rows: zero already (ReLU(0)^p = 0)
    return cfg, q_same, q_opposite, kf, v, real_key_count(cfg, k)


def _split(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The value channels of the same-sign stream (the first ceil(D/2)) and of the opposite-sign one."""
    half = (v.shape[-1] + 1) // 2
    return v[..., :half], v[..., half:]


def polarity_linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    power: torch.Tensor | float = 3.0,
    feature_scale: torch.Tensor | float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The matrix form: one (Nq, Nk) matrix per stream, S = phi(Q) phi(K)^T / n, out = S V / (S 1 + 1e-6)."""
    cfg, q_same, q_opp, kf, v32, n = _features(
        q, k, v, power, feature_scale, key_padding_mask, query_padding_mask, dropout_p
    )
    v_same, v_opp = _split(v32)
    out = torch.cat(
        [
            normalised_linear_reference(q_same, kf, v_same, EPS, n),
            normalised_linear_reference(q_opp, kf, v_opp, EPS, n),
        ],
        -1,
    )
    return finish(out, cfg, q.dtype)


def polarity_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    power: torch.Tensor | float = 3.0,
    feature_scale: torch.Tensor | float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Polarity-aware linear attention on (B, H, N, D) tensors in O(N D^2).

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        power (torch.Tensor | float): p >= 1 of the power function, a float or a tensor broadcastable
            to (Hkv, D); query head h uses its kv head's. Default: 3.0 (the layer's value at initialisation).
        feature_scale (torch.Tensor | float | None): s > 0 dividing q and k, a float or a tensor
            broadcastable to (Hkv, D). None means 1. Default: None.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype: channels [0, ceil(D/2)) from the same-sign
        stream, the rest from the opposite-sign one; rows of padded queries are zero.
    """
    cfg, q_same, q_opp, kf, v32, n = _features(
        q, k, v, power, feature_scale, key_padding_mask, query_padding_mask, dropout_p
    )
    v_same, v_opp = _split(v32)
    out = torch.cat([normalised_linear(q_same, kf, v_same, EPS, n), normalised_linear(q_opp, kf, v_opp, EPS, n)], -1)
    return finish(out, cfg, q.dtype)


def pola_flops(n: int, d: int, **_: object) -> float:
    """phi(K)^T V with 2D features (4 N D^2), each stream's queries times its half (2 N D^2 each),
    the normalisers (8 N D) and the features (8 N D)."""
    return 8 * n * d * d + 16 * n * d
