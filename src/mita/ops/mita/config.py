"""Argument checking for :func:`mita.mita_attention`, shared by every implementation.

Every bad input raises a ``ValueError`` or ``TypeError`` that names the argument and
says what would be valid, before any arithmetic runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MiTAConfig:
    """The call's arguments, checked and resolved to concrete values."""

    m: int  # number of landmarks (= experts)
    topk: int  # keys per expert, after clamping to the number of real keys
    num_routed: int  # experts per query (s)
    pool_shape: tuple[int, ...]  # (m,) for 1-D pooling, (mh, mw) for 2-D
    grid: tuple[int, int] | None
    num_prefix_tokens: int
    scale: float
    landmark_scale: float
    key_mask: torch.Tensor | None  # (B, Nk) bool, True = real key
    query_mask: torch.Tensor | None  # (B, Nq) bool, True = real query (self-attention only)
    short_keys: bool  # some sequence has fewer real keys than topk: experts hold padded slots
    branches: str = "both"  # "both", or an ablation: "shared" (shared expert only), "routed" (no shared expert)

    @property
    def use_shared(self) -> bool:
        return self.branches != "routed"

    @property
    def use_routed(self) -> bool:
        return self.branches != "shared"


def _landmark_shape(num_landmarks: int | tuple[int, int], grid: tuple[int, int] | None) -> tuple[int, ...]:
    if grid is None:
        if not isinstance(num_landmarks, int) or isinstance(num_landmarks, bool) or num_landmarks < 1:
            raise ValueError(f"num_landmarks must be an int >= 1 for 1-D pooling (grid=None), got {num_landmarks!r}")
        return (num_landmarks,)
    if isinstance(num_landmarks, int) and not isinstance(num_landmarks, bool):
        side = math.isqrt(max(num_landmarks, 0))
        if num_landmarks < 1 or side * side != num_landmarks:
            raise ValueError(
                f"num_landmarks={num_landmarks} with a 2-D grid must be a perfect square (e.g. 25, 49) "
                "or a pair (mh, mw)"
            )
        return (side, side)
    if (
        isinstance(num_landmarks, (tuple, list))
        and len(num_landmarks) == 2
        and all(isinstance(x, int) and x >= 1 for x in num_landmarks)
    ):
        return (int(num_landmarks[0]), int(num_landmarks[1]))
    raise ValueError(
        f"num_landmarks with a 2-D grid must be a perfect square int or a pair (mh, mw), got {num_landmarks!r}"
    )


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_landmarks: int | tuple[int, int],
    topk: int,
    num_routed: int,
    grid: tuple[int, int] | None,
    num_prefix_tokens: int,
    key_padding_mask: torch.Tensor | None,
    scale: float | None,
    landmark_scale: float | None,
    landmarks: torch.Tensor | None,
    branches: str = "both",
) -> MiTAConfig:
    """Validate the arguments of ``mita_attention`` and resolve defaults."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D), got {tuple(t.shape)} (rank {t.dim()})")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use float64, float32, bfloat16 or float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, Nq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, Nk, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv, Nk, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    Hkv, Nk = k.shape[1], k.shape[2]
    if B < 1 or H < 1 or D < 1 or Hkv < 1:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have B, H, D >= 1")
    if H % Hkv != 0:
        raise ValueError(f"the number of query heads H={H} must be a multiple of the kv heads Hkv={Hkv}")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"empty sequence: q has Nq={Nq} and k has Nk={Nk} tokens; both need at least one")

    if not isinstance(num_prefix_tokens, int) or not 0 <= num_prefix_tokens < Nq:
        raise ValueError(f"num_prefix_tokens must be an int in [0, Nq={Nq}), got {num_prefix_tokens!r}")
    if grid is not None:
        if not (
            isinstance(grid, (tuple, list)) and len(grid) == 2 and all(isinstance(g, int) and g >= 1 for g in grid)
        ):
            raise ValueError(f"grid must be None or a pair of ints (gh, gw), got {grid!r}")
        grid = (int(grid[0]), int(grid[1]))
        if grid[0] * grid[1] != Nq - num_prefix_tokens:
            raise ValueError(
                f"grid={grid} holds {grid[0] * grid[1]} tokens but q has Nq - num_prefix_tokens = "
                f"{Nq - num_prefix_tokens}; pass the patch grid of the pooled tokens"
            )
    pool_shape = _landmark_shape(num_landmarks, grid)
    m = math.prod(pool_shape)

    if landmarks is not None:
        if not isinstance(landmarks, torch.Tensor) or landmarks.dim() != 4:
            raise ValueError("landmarks must be a tensor of shape (B, H, m, D)")
        if landmarks.shape[0] != B or landmarks.shape[1] != H or landmarks.shape[3] != D:
            raise ValueError(f"landmarks must have shape (B={B}, H={H}, m, D={D}), got {tuple(landmarks.shape)}")
        if landmarks.dtype != q.dtype or landmarks.device != q.device:
            raise TypeError(f"landmarks must match q's dtype {q.dtype} and device {q.device}")
        m = landmarks.shape[2]
        if m < 1:
            raise ValueError("landmarks must hold at least one landmark (m >= 1)")
        pool_shape = (m,)

    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if not isinstance(num_routed, int) or isinstance(num_routed, bool) or not 1 <= num_routed <= m:
        raise ValueError(f"num_routed must be an int in [1, num_landmarks={m}], got {num_routed!r}")

    key_mask = query_mask = None
    n_real = n_real_min = Nk
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = (
                key_padding_mask.dtype
                if isinstance(key_padding_mask, torch.Tensor)
                else type(key_padding_mask).__name__
            )
            raise TypeError(f"key_padding_mask must be a bool tensor (True = real token), got {got}")
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(f"key_padding_mask must have shape (B={B}, Nk={Nk}), got {tuple(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
        counts = key_padding_mask.sum(1)
        if bool((counts == 0).any()):
            bad = torch.nonzero(counts == 0).flatten().tolist()
            raise ValueError(f"key_padding_mask marks no real token in batch element(s) {bad}; drop those sequences")
        n_real, n_real_min = int(counts.max()), int(counts.min())
        key_mask = key_padding_mask
        if Nq == Nk:  # self-attention: the mask marks the real queries too
            query_mask = key_padding_mask
            pooled = key_padding_mask[:, num_prefix_tokens:].sum(1)
            if landmarks is None and bool((pooled == 0).any()):
                bad = torch.nonzero(pooled == 0).flatten().tolist()
                raise ValueError(
                    f"batch element(s) {bad} have no real token after the {num_prefix_tokens} prefix tokens "
                    "to pool landmarks from"
                )

    if branches not in ("both", "shared", "routed"):
        raise ValueError(f"branches must be 'both', 'shared' or 'routed', got {branches!r}")
    s0 = D**-0.5 if scale is None else float(scale)
    ls = s0 if landmark_scale is None else float(landmark_scale)
    return MiTAConfig(
        m=m,
        topk=min(topk, n_real),
        num_routed=num_routed,
        pool_shape=pool_shape,
        grid=grid,
        num_prefix_tokens=num_prefix_tokens,
        scale=s0,
        landmark_scale=ls,
        key_mask=key_mask,
        query_mask=query_mask,
        branches=branches,
        short_keys=key_mask is not None and min(topk, n_real) > n_real_min,
    )
