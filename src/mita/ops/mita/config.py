"""Argument checking for :func:`mita.mita_attention`, shared by every implementation.

MiTA's own checks (m, k, s, the pooling grid, given landmarks, the landmark scale, the options
against repeated tokens) on top of the base check every op shares
(:func:`mita.ops.checks.check_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import AttentionArgs, check_attention, check_int, check_scale, host_readable, require
from ..pooling import Pooling, check_pooling
from .landmarks import key_offsets

LANDMARK_POOLINGS = ("mean", "distinct")


@dataclass(frozen=True)
class MiTAConfig(AttentionArgs):
    """The call's arguments, checked and resolved to concrete values."""

    m: int  # number of landmarks (= experts)
    topk: int  # keys per expert, after clamping to the number of real keys
    num_routed: int  # experts per query (s)
    pooling: Pooling  # how the landmarks are pooled (its shape is (m,) when landmarks are given)
    landmark_scale: float
    short_keys: bool  # some sequence has fewer real keys than topk: experts hold padded slots
    branches: str = "both"  # "both", or an ablation: "shared" (shared expert only), "routed" (no shared expert)
    landmark_pooling: str = "mean"  # "mean" (the spec's) or "distinct" (each distinct query counted once)
    # merge_duplicates: the (B, Hkv, Nk) logit offset of each key (float64 for float64 keys, else float32):
    # log(copies) on the first of each group of equal (key, value) pairs, -inf on its other copies and
    # on padded keys; None: off
    key_offset: torch.Tensor | None = None

    @property
    def use_shared(self) -> bool:
        return self.branches != "routed"

    @property
    def use_routed(self) -> bool:
        return self.branches != "shared"

    @property
    def grid(self) -> tuple[int, ...] | None:
        return self.pooling.grid

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return self.pooling.shape

    @property
    def num_prefix_tokens(self) -> int:
        return self.pooling.num_prefix_tokens

    @property
    def num_suffix_tokens(self) -> int:
        return self.pooling.num_suffix_tokens


def check_repeat_options(landmark_pooling: object, merge_duplicates: object) -> None:
    """Check the options against repeated tokens: ``landmark_pooling`` and ``merge_duplicates``."""
    if landmark_pooling not in LANDMARK_POOLINGS:
        raise ValueError(f"landmark_pooling must be one of {list(LANDMARK_POOLINGS)}, got {landmark_pooling!r}")
    if not isinstance(merge_duplicates, bool):
        kind = type(merge_duplicates).__name__
        raise TypeError(f"merge_duplicates must be True or False, got {kind} {merge_duplicates!r}")


def check(
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
    branches: str = "both",
    dropout_p: float = 0.0,
    landmark_pooling: str = "mean",
    merge_duplicates: bool = False,
) -> MiTAConfig:
    """Validate the arguments of ``mita_attention`` and resolve defaults."""
    base = check_attention(
        q,
        k,
        v,
        key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask,
        dropout_p=dropout_p,
        scale=scale,
    )
    B, H, Nq, D = q.shape
    check_repeat_options(landmark_pooling, merge_duplicates)
    if landmark_pooling != "mean" and landmarks is not None:
        raise ValueError(
            f"landmark_pooling={landmark_pooling!r} pools the landmarks, so landmarks= cannot be given too; "
            "pass one of them"
        )
    pooling = check_pooling(num_landmarks, grid, num_prefix_tokens, Nq, num_suffix_tokens=num_suffix_tokens)
    if landmarks is not None:
        if not isinstance(landmarks, torch.Tensor) or landmarks.dim() != 4:
            raise ValueError("landmarks must be a tensor of shape (B, H, m, D)")
        if landmarks.shape[0] != B or landmarks.shape[1] != H or landmarks.shape[3] != D:
            raise ValueError(f"landmarks must have shape (B={B}, H={H}, m, D={D}), got {tuple(landmarks.shape)}")
        if landmarks.dtype != q.dtype or landmarks.device != q.device:
            raise TypeError(f"landmarks must match q's dtype {q.dtype} and device {q.device}")
        if landmarks.shape[2] < 1:
            raise ValueError("landmarks must hold at least one landmark (m >= 1)")
        pooling = Pooling((landmarks.shape[2],), None, pooling.num_prefix_tokens, pooling.num_suffix_tokens)
    elif base.query_mask is not None:
        pooled = base.query_mask[:, pooling.span(Nq)].any(1)

        def nothing_to_pool() -> ValueError:
            bad = torch.nonzero(~pooled).flatten().tolist() if host_readable(pooled) else "some"
            return ValueError(
                f"batch element(s) {bad} have no real query besides the {pooling.num_prefix_tokens} prefix and "
                f"{pooling.num_suffix_tokens} suffix tokens to pool landmarks from"
            )

        require(pooled, nothing_to_pool)
    m = pooling.m
    topk = check_int("topk", topk)
    num_routed = check_int("num_routed", num_routed, 1, m)
    if branches not in ("both", "shared", "routed"):
        raise ValueError(f"branches must be 'both', 'shared' or 'routed', got {branches!r}")
    ls = check_scale("landmark_scale", landmark_scale, q.dtype)
    n_real = n_real_min = k.shape[2]
    if base.key_mask is not None:
        if host_readable(base.key_mask):
            counts = base.key_mask.sum(1)
            n_real, n_real_min = int(counts.max()), int(counts.min())
        else:  # no host sync: k clamped to Nk, every padded slot masked (same output, wider experts)
            n_real_min = 0
    offset = key_offsets(k, v, base.key_mask) if merge_duplicates else None
    if offset is not None and host_readable(offset):  # experts hold distinct keys: k clamped to their count
        n_real = int(torch.isfinite(offset).sum(-1).max())
    return MiTAConfig(
        scale=base.scale,
        key_mask=base.key_mask,
        query_mask=base.query_mask,
        m=m,
        topk=min(topk, n_real),
        num_routed=num_routed,
        pooling=pooling,
        landmark_scale=base.scale if ls is None else ls,
        short_keys=base.key_mask is not None and min(topk, n_real) > n_real_min,
        branches=branches,
        landmark_pooling=landmark_pooling,
        key_offset=offset,
    )
