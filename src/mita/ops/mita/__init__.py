"""MiTA attention (Mixture of Top-k Activations), spec section 2.

``naive.py`` is the reference that reads like the spec; ``grouped.py`` is the portable
linear-memory path (any device, autograd); ``fused.py`` runs C++ kernels on CPU
(forward and backward). :func:`mita_attention` checks the arguments and picks one.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from . import fused
from .config import MiTAConfig, check
from .fused import mita_attention_fused
from .grouped import mita_attention_grouped
from .naive import mita_attention_reference

IMPLEMENTATIONS = {
    "reference": mita_attention_reference,
    "grouped": mita_attention_grouped,
    "fused": mita_attention_fused,
}


class MiTARouting(NamedTuple):
    """What a MiTA call decided: landmarks (B,H,m,D), experts (B,H,m,k), routes (B,H,Nq,s)."""

    landmarks: torch.Tensor
    experts: torch.Tensor
    routes: torch.Tensor


def mita_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_landmarks: int | tuple[int, int],
    topk: int,
    num_routed: int = 1,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    landmark_scale: float | None = None,
    landmarks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    branches: Literal["both", "shared", "routed"] = "both",
    return_routing: bool = False,
    impl: Literal["auto", "fused", "grouped", "reference"] = "auto",
) -> torch.Tensor | tuple[torch.Tensor, MiTARouting]:
    """MiTA attention on (B, H, N, D) tensors, like ``F.scaled_dot_product_attention``.

    Args:
        q: queries (B, H, Nq, D). k, v: keys and values (B, Hkv, Nk, D), H a multiple of Hkv.
        num_landmarks: m, or (mh, mw) / a perfect square with a 2-D ``grid``.
        topk: keys per deformable expert (clamped to the number of real keys).
        num_routed: s, the experts each query is routed to (1 <= s <= m).
        grid: (gh, gw) patch grid of the pooled tokens for 2-D pooling; None pools in 1-D.
        num_prefix_tokens: leading tokens (CLS, registers) that attend but are not pooled.
        key_padding_mask: bool (B, Nk), True = real token; in self-attention it also marks queries.
        scale: s0, default D**-0.5. landmark_scale: scale of the landmark logits, default s0.
        landmarks: (B, H, m, D) landmarks to use instead of pooling.
        dropout_p: dropout on the attention probabilities (pass 0 in evaluation).
        branches: "both" (MiTA), or the paper's ablations "shared" (shared expert only) and
            "routed" (routed experts only, no shared expert).
        return_routing: also return a :class:`MiTARouting` for analysis.
        impl: "fused" (C++ kernels, forward and backward: CPU, no dropout, both branches; half
            precision computed in float32),
            "grouped" (pure PyTorch, linear memory, any device, trainable), "reference" (the
            spec's steps, quadratic memory), or "auto": "fused" where it applies, else "grouped".
    """
    if impl not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"impl must be one of {['auto', *IMPLEMENTATIONS]}, got {impl!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    cfg = check(
        q, k, v,
        num_landmarks=num_landmarks, topk=topk, num_routed=num_routed, grid=grid,
        num_prefix_tokens=num_prefix_tokens, key_padding_mask=key_padding_mask, scale=scale,
        landmark_scale=landmark_scale, landmarks=landmarks, branches=branches,
    )  # fmt: skip
    if impl == "auto":
        fast = fused.supports(q, cfg, dropout_p) and fused.available()
        impl = "fused" if fast else "grouped"
    out, routing = IMPLEMENTATIONS[impl](q, k, v, cfg, landmarks=landmarks, dropout_p=dropout_p)
    return (out, MiTARouting(*routing)) if return_routing else out


def official_landmarks(q: torch.Tensor, num_landmarks: int | tuple[int, int]) -> torch.Tensor:
    """The authors' DeiT landmarks: 2-D pooling of the first N-1 tokens on a floor(sqrt(N)) grid."""
    B, H, N, D = q.shape
    side = math.isqrt(N)
    if side * side != N - 1:
        raise ValueError(f"compat='official' needs N - 1 to be a square (N = 197, 1025, ...), got N={N}")
    mh, mw = check(
        q, q, q, num_landmarks=num_landmarks, topk=1, num_routed=1, grid=(side, side),
        num_prefix_tokens=N - side * side, key_padding_mask=None, scale=None, landmark_scale=None, landmarks=None,
    ).pool_shape  # fmt: skip
    img = q[:, :, : N - 1].transpose(-1, -2).reshape(B * H, D, side, side)
    return F.adaptive_avg_pool2d(img, (mh, mw)).reshape(B, H, D, mh * mw).transpose(-1, -2)


__all__ = [
    "MiTAConfig",
    "MiTARouting",
    "mita_attention",
    "mita_attention_fused",
    "mita_attention_grouped",
    "mita_attention_reference",
    "official_landmarks",
]
