"""MiTA attention (Mixture of Top-k Activations), spec section 2.

``reference.py`` is the reference that reads like the spec; ``grouped.py`` is the portable
linear-memory path (any device, autograd); ``fused.py`` runs C++ kernels on CPU
(forward and backward). :func:`mita_attention` checks the arguments and picks one.
``landmarks.py`` holds the two options against repeated tokens (issue 31): distinct landmark
pooling (given to every implementation as landmarks) and merged duplicate keys (a per-key logit
offset that the reference, the grouped path and the fused kernels take; the Triton kernels
decline it).
"""

from __future__ import annotations

import contextlib
import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from ..checks import check_dropout
from ..pooling import check_pooling
from . import fused, triton
from .config import MiTAConfig, check
from .fused import mita_attention_fused
from .grouped import mita_attention_grouped
from .landmarks import distinct_pool
from .reference import mita_attention_reference
from .triton import mita_attention_triton

IMPLEMENTATIONS = {
    "reference": mita_attention_reference,
    "grouped": mita_attention_grouped,
    "fused": mita_attention_fused,
    "triton": mita_attention_triton,
}


#: the implementations that take merged duplicate keys: a per-key logit offset
MERGING = ("fused", "grouped", "reference")


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
    num_landmarks: int | tuple[int, ...],
    topk: int,
    num_routed: int = 1,
    grid: tuple[int, ...] | None = None,
    num_prefix_tokens: int = 0,
    num_suffix_tokens: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    landmark_scale: float | None = None,
    landmarks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    branches: Literal["both", "shared", "routed"] = "both",
    landmark_pooling: Literal["mean", "distinct"] = "mean",
    merge_duplicates: bool = False,
    return_routing: bool = False,
    impl: Literal["auto", "fused", "grouped", "reference", "triton"] = "auto",
) -> torch.Tensor | tuple[torch.Tensor, MiTARouting]:
    """MiTA attention on (B, H, N, D) tensors, like ``F.scaled_dot_product_attention``.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        num_landmarks (int | tuple): m. An int >= 1 in 1-D; with a grid, (mh, mw) or a perfect
            square in 2-D, (mt, mh, mw) or a perfect cube in 3-D.
        topk (int): keys per deformable expert, clamped to the number of real keys.
        num_routed (int): s, the experts each query is routed to, 1 <= s <= m. Default: 1.
        grid (tuple | None): the row-major layout of the pooled tokens: None (1-D pooling),
            (gh, gw) (2-D) or (gt, gh, gw) (3-D, video); its product is
            Nq - num_prefix_tokens - num_suffix_tokens. Default: None.
        num_prefix_tokens (int): leading tokens (CLS, registers) that attend but are not pooled.
            Default: 0.
        num_suffix_tokens (int): trailing tokens (ViT-5's registers) that attend but are not pooled.
            Default: 0.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. If None and
            Nq == Nk, the key mask marks the queries too (self-attention); pass one (all True if
            no query is padded) to say the call is cross-attention. Default: None.
        scale (float | None): s0, positive and finite. Default: D**-0.5.
        landmark_scale (float | None): scale of the landmark logits, positive and finite.
            Default: ``scale``.
        landmarks (torch.Tensor | None): (B, H, m, D) landmarks to use instead of pooling.
            Default: None.
        dropout_p (float): dropout on the attention probabilities (pass 0 in evaluation).
            Default: 0.0.
        branches (str): "both" (MiTA), or the paper's ablations "shared" (shared expert only)
            and "routed" (routed experts only). Default: "both".
        landmark_pooling (str): "mean" (the spec's: each bin's queries averaged) or "distinct" (each
            query weighted by 1 / its copies in the sequence, so a repeated token counts once;
            :func:`~mita.ops.mita.landmarks.distinct_landmarks`). Not with ``landmarks``. Default: "mean".
        merge_duplicates (bool): each group of equal (key, value) pairs of a kv head is one key of
            weight c (its copies): experts hold the top-k distinct keys by the shared expert's mass and
            a kept key's logit is raised by log c, so its weight is that of all its copies. Runs on
            "fused", "grouped" and "reference", not "triton" ("auto" picks "grouped" on CUDA).
            Default: False.
        return_routing (bool): also return a :class:`MiTARouting`. Default: False.
        impl (str): "fused" (C++ kernels, forward and backward: CPU, no dropout, both branches;
            half precision computed in float32), "triton" (Triton kernels, forward and backward:
            CUDA, no dropout, both branches, D <= 256, float32/float16/bfloat16), "grouped" (pure
            PyTorch, linear memory, any device, trainable), "reference" (the spec's steps,
            quadratic memory), or "auto": "fused" on CPU and "triton" on CUDA where they apply,
            else "grouped". Default: "auto".

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype, zero on padded queries; with
        ``return_routing``, the pair (output, :class:`MiTARouting`).
    """
    if impl not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"impl must be one of {['auto', *IMPLEMENTATIONS]}, got {impl!r}")
    dropout_p = check_dropout(dropout_p)
    low = _autocast_dtype(q)
    if low is not None:  # like SDPA: computed in the autocast dtype; float64 stays float64
        q, k, v, landmarks = (_autocast(t, low) for t in (q, k, v, landmarks))
    with torch.autocast(q.device.type, enabled=False) if low is not None else contextlib.nullcontext():
        cfg = check(
            q,
            k,
            v,
            num_landmarks=num_landmarks,
            topk=topk,
            num_routed=num_routed,
            grid=grid,
            num_prefix_tokens=num_prefix_tokens,
            num_suffix_tokens=num_suffix_tokens,
            key_padding_mask=key_padding_mask,
            query_padding_mask=query_padding_mask,
            scale=scale,
            landmark_scale=landmark_scale,
            landmarks=landmarks,
            branches=branches,
            dropout_p=dropout_p,
            landmark_pooling=landmark_pooling,
            merge_duplicates=merge_duplicates,
        )
        if cfg.landmark_pooling == "distinct":
            landmarks = distinct_pool(q, cfg.pooling, cfg.query_mask)
        if impl == "auto":
            impl = _auto(q, cfg, dropout_p)
        elif cfg.key_offset is not None and impl not in MERGING:
            raise ValueError(
                f"impl={impl!r} cannot run merge_duplicates=True (its kernels take no per-key offset); "
                f"use impl='auto' or one of {list(MERGING)}"
            )
        out, routing = IMPLEMENTATIONS[impl](q, k, v, cfg, landmarks=landmarks, dropout_p=dropout_p)
    return (out, MiTARouting(*routing)) if return_routing else out


def _auto(q: torch.Tensor, cfg: MiTAConfig, dropout_p: float) -> str:
    """The implementation "auto" picks: fused on CPU, triton on CUDA where they apply, else grouped.

    A CUDA call the Triton kernels cannot take only for its head dim or dtype warns once; merged
    duplicates (which the Triton kernels do not take) run on the grouped path there without a warning.
    """
    if cfg.key_offset is not None and q.device.type == "cuda":
        return "grouped"
    if q.device.type == "cuda":
        if not triton.available():
            return "grouped"
        reasons = triton.not_supported_reasons(q, cfg, dropout_p)
        if reasons and not dropout_p and cfg.branches == "both":
            triton.warn_once(f"mita: impl='auto' uses the grouped path: {'; '.join(reasons)}")
        return "grouped" if reasons else "triton"
    fast = not fused.not_supported_reasons(q, cfg, dropout_p) and fused.available()
    return "fused" if fast else "grouped"


def _autocast(t: object, dtype: torch.dtype) -> object:
    """t cast as autocast casts an op's inputs: floating tensors other than float64 to ``dtype``."""
    eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
    return t.to(dtype) if eligible else t


def _autocast_dtype(q: object) -> torch.dtype | None:
    """The autocast dtype in effect for q's device, None if autocast is off (or q is no tensor)."""
    if not isinstance(q, torch.Tensor):
        return None
    try:
        enabled = torch.is_autocast_enabled(q.device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    return torch.get_autocast_dtype(q.device.type) if enabled else None


def official_landmarks(q: torch.Tensor, num_landmarks: int | tuple[int, int]) -> torch.Tensor:
    """The authors' DeiT landmarks: 2-D pooling of the first N-1 tokens on a floor(sqrt(N)) grid.

    Args:
        q (torch.Tensor): queries of shape (B, H, N, D), N - 1 a perfect square.
        num_landmarks (int | tuple): (mh, mw) or a perfect square.

    Returns:
        The landmarks, of shape (B, H, mh * mw, D).
    """
    B, H, N, D = q.shape
    side = math.isqrt(N)
    if side * side != N - 1:
        raise ValueError(f"compat='official' needs N - 1 to be a square (N = 197, 1025, ...), got N={N}")
    mh, mw = check_pooling(num_landmarks, (side, side), N - side * side, N).shape
    img = q[:, :, : N - 1].transpose(-1, -2).reshape(B * H, D, side, side)
    return F.adaptive_avg_pool2d(img, (mh, mw)).reshape(B, H, D, mh * mw).transpose(-1, -2)


def mita_flops(
    n: int,
    d: int,
    num_landmarks: int | tuple[int, ...] = 64,
    topk: int = 64,
    num_routed: int = 1,
    branches: str = "both",
    **_: object,
) -> float:
    """Spec section 3: N D (8m + 4sk) per head (top-k and routing, O(mN), not counted).

    The ablations drop their branch: "shared" the routed keys (8 N m D), "routed" the
    shared values and their logits (N D (4m + 4sk)).
    """
    m = num_landmarks if isinstance(num_landmarks, int) else math.prod(num_landmarks)
    routed = 4 * num_routed * min(topk, n)
    return n * d * {"both": 8 * m + routed, "shared": 8 * m, "routed": 4 * m + routed}[branches]


__all__ = [
    "MiTAConfig",
    "MiTARouting",
    "mita_attention",
    "mita_attention_fused",
    "mita_attention_grouped",
    "mita_attention_reference",
    "mita_attention_triton",
    "mita_flops",
    "official_landmarks",
]
