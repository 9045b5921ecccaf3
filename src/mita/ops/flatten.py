"""Focused linear attention (Han, Pan, Han, Song and Huang, "FLatten Transformer: Vision Transformer
using Focused Linear Attention", ICCV 2023).

Linear attention with the focused feature map phi_p(x) = f_p((ReLU(x) + 1e-6) / s), where s > 0 is
a learned per-channel scale (the layer's parameter, softplus of zero at initialisation) and the
focusing function f_p(y) = ||y|| y^p / ||y^p|| (element-wise power, factor p = 3 in the paper)
keeps each feature vector's norm while sharpening its direction towards its largest channels,
so similar queries and keys score higher and dissimilar ones lower, like softmax's focus:
out_i = phi(q_i) . sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + 1e-6), the constants as
in the authors' code. One shared linear expert built by kernelization (spec section 5). The
reference forms the (Nq, Nk) matrix; the efficient path a D x D state per kv head. The
depth-wise convolution on V (the paper's rank restoration module) belongs to the layer,
:class:`mita.layers.kernelized.FLattenAttention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernelized import (
    check_linear,
    check_positive,
    finish,
    for_queries,
    head_tensor,
    mask_features,
    normalised_linear,
    normalised_linear_reference,
)

#: the authors' constants: added to ReLU's output before the power, and to the normaliser
EPS = 1e-6


def focus(x: torch.Tensor, p: float, scale: torch.Tensor | float) -> torch.Tensor:
    """phi_p(x) = f_p((ReLU(x) + eps) / scale), f_p(y) = ||y|| y^p / ||y^p||, over the last dim.

    y^p / ||y^p|| is computed as (y / max y)^p / ||(y / max y)^p||, the same value without
    overflow for large p; the max is a constant there (the ratio does not depend on it).
    """
    y = (F.relu(x) + EPS) / scale
    y_p = (y / y.amax(-1, keepdim=True).detach()) ** p
    return y.norm(dim=-1, keepdim=True) * y_p / y_p.norm(dim=-1, keepdim=True)


def _features(q, k, v, focusing_factor, feature_scale, key_padding_mask, query_padding_mask, dropout_p):
    """Checked arguments, the focused features of q and k (padded rows zero) and v."""
    cfg, q, k, v = check_linear("focused linear attention", q, k, v, key_padding_mask, query_padding_mask, dropout_p)
    p = check_positive("focusing_factor", focusing_factor)
    scale = head_tensor("feature_scale", 1.0 if feature_scale is None else feature_scale, k)
    qf, kf = mask_features(focus(q, p, for_queries(scale, q.shape[1])), focus(k, p, scale), cfg)
    return cfg, qf, kf, v


def focused_linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    focusing_factor: float = 3.0,
    feature_scale: torch.Tensor | float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The matrix form: S = phi(Q) phi(K)^T, out = S V / (S 1 + 1e-6)."""
    cfg, qf, kf, v32 = _features(
        q, k, v, focusing_factor, feature_scale, key_padding_mask, query_padding_mask, dropout_p
    )
    return finish(normalised_linear_reference(qf, kf, v32, EPS), cfg, q.dtype)


def focused_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    focusing_factor: float = 3.0,
    feature_scale: torch.Tensor | float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Focused linear attention on (B, H, N, D) tensors in O(N D^2).

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        focusing_factor (float): p > 0 of the focusing function. Default: 3.0 (the paper's).
        feature_scale (torch.Tensor | float | None): s > 0, a float or a tensor broadcastable to
            (Hkv, D); query head h uses its kv head's. None means 1. Default: None.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, qf, kf, v32 = _features(
        q, k, v, focusing_factor, feature_scale, key_padding_mask, query_padding_mask, dropout_p
    )
    return finish(normalised_linear(qf, kf, v32, EPS), cfg, q.dtype)


def flatten_flops(n: int, d: int, **_: object) -> float:
    """phi(K)^T V and phi(Q) times it (2 N D^2 each), the normaliser (4 N D) and the features (8 N D)."""
    return 4 * n * d * d + 12 * n * d
