"""MiTA's two options against repeated tokens (issue 31, ``docs/recall.md``): landmarks by content
and merged duplicate keys.

The spec pools the queries of each bin with equal weights (spec section 2, step 1), so a token
repeated across a bin (filler, padding, a uniform image region) makes the bin's landmark its
copy, whatever the few other tokens hold: the landmarks become near one vector, their experts
alike, and routing carries no information. With ``landmark_pooling="distinct"`` each query is
weighted by 1 / (its copies in the sequence): a bin's landmark is the mean of its *distinct*
queries, and a bin of one repeated token alone still pools to that token (:func:`distinct_pool`).

With ``merge_duplicates=True`` each group of equal (key, value) pairs is one key of weight c (its
copies): :func:`key_offsets` gives its lowest-index member the logit offset log c and the other
copies -inf, so the shared expert is the spec's over every copy, each expert holds the top-k
*distinct* keys by that mass (not k copies of one), and a kept key's softmax weight is that of
all its copies.

Equal vectors (within a relative :data:`DUP_TOL`) are found in O(N log N) per head
(:func:`duplicate_groups`), never with an N x N matrix; the weights and offsets are constants (no
gradient): the pooled queries and the groups' first keys and values carry it.
"""

from __future__ import annotations

import math

import torch

from ..pooling import Pooling, check_pooling, pool

__all__ = ["DUP_TOL", "distinct_landmarks", "distinct_pool", "duplicate_groups", "key_offsets"]

#: relative distance under which two vectors count as one
DUP_TOL = 1e-5


@torch.no_grad()
def duplicate_groups(x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of equal vectors along the token axis of x (B, H, N, D).

    Vectors are sorted by a fixed projection (equal vectors project equally, so they are
    adjacent) and neighbours closer than :data:`DUP_TOL` times the larger norm are one group.

    Args:
        x (torch.Tensor): (B, H, N, D) vectors.
        mask (torch.Tensor | None): (B, N) bool, True = real token; padded tokens are in no
            group. Default: all real.

    Returns:
        ``copies`` (B, H, N) float32: the size of each real token's group (1 on padded tokens),
        and ``first`` (B, H, N) bool: True on the lowest-index member of each group.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a (B, H, N, D) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    B, H, N, D = x.shape
    if mask is not None and (mask.shape != (B, N) or mask.dtype != torch.bool):
        raise ValueError(f"mask must be a bool tensor of shape (B, N) = {(B, N)}, got {tuple(mask.shape)} {mask.dtype}")
    real = torch.ones(B, N, dtype=torch.bool, device=x.device) if mask is None else mask
    real = real[:, None, :].expand(B, H, N)
    xf = x.float() if mask is None else x.float().masked_fill(~real[..., None], 0)  # (no copy without padding)
    direction = torch.cos(torch.arange(D, device=x.device, dtype=torch.float32) * 1.3 + 0.5)  # fixed: no RNG drawn
    order = (xf @ direction).masked_fill(~real, float("inf")).argsort(dim=-1, stable=True)
    # the rows in that order, by whole rows (a gather with the index expanded over D took 5x as long)
    rows = (order + torch.arange(B * H, device=x.device).view(B, H, 1) * N).flatten()
    xs = xf.reshape(B * H * N, D).index_select(0, rows).view(B, H, N, D)
    rs = real.gather(2, order)
    norm = xs.norm(dim=-1)
    close = (xs[..., 1:, :] - xs[..., :-1, :]).norm(dim=-1) <= DUP_TOL * torch.maximum(norm[..., 1:], norm[..., :-1])
    same = torch.cat([torch.zeros_like(rs[..., :1]), close & rs[..., 1:] & rs[..., :-1]], -1)
    group = (~same).long().cumsum(-1) - 1
    size = torch.zeros(B, H, N, device=x.device).scatter_add(2, group, rs.float())
    copies = torch.empty(B, H, N, device=x.device).scatter(2, order, torch.where(rs, size.gather(2, group), 1.0))
    # the lowest index of each group (near-equal vectors may sort in either order)
    lowest = torch.full((B, H, N), N, dtype=order.dtype, device=x.device).scatter_reduce(2, group, order, "amin")
    first = torch.empty_like(rs).scatter(2, order, (lowest.gather(2, group) == order) & rs)
    return copies, first


@torch.no_grad()
def key_offsets(k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The logit offset of every key when equal (key, value) pairs are merged (``merge_duplicates``).

    Args:
        k (torch.Tensor): (B, Hkv, Nk, D) keys.
        v (torch.Tensor): (B, Hkv, Nk, D) values.
        key_padding_mask (torch.Tensor | None): (B, Nk) bool, True = real key. Default: all real.

    Returns:
        (B, Hkv, Nk), float64 for float64 keys, else float32: log(copies) on the lowest-index member
        of each group of equal (key, value) pairs, -inf on its other copies and on padded keys.
    """
    copies, first = duplicate_groups(torch.cat([k, v], -1), key_padding_mask)
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    return copies.to(acc).log().masked_fill(~first, -math.inf)


def distinct_pool(q: torch.Tensor, pooling: Pooling, query_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`distinct_landmarks` for checked pooling arguments (a :class:`~mita.ops.pooling.Pooling`)."""
    if query_padding_mask is not None:  # padded queries may hold anything (NaN): they reach no product
        q = q.masked_fill(~query_padding_mask[:, None, :, None], 0)
    copies, _ = duplicate_groups(q.detach(), query_padding_mask)
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    weight = (1.0 / copies).to(acc)[..., None]
    pooled = pool(q.to(acc) * weight, pooling, query_padding_mask) / pool(weight, pooling, query_padding_mask)
    return pooled.to(q.dtype)


def distinct_landmarks(
    q: torch.Tensor,
    num_landmarks: int | tuple[int, ...],
    *,
    grid: tuple[int, ...] | None = None,
    num_prefix_tokens: int = 0,
    num_suffix_tokens: int = 0,
    query_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """MiTA's landmarks with each distinct query counted once: per bin, the mean of its queries
    weighted by 1 / (copies of that query in the sequence) (``landmark_pooling="distinct"``).

    The bins are the spec's (1-D, 2-D or 3-D, prefix and suffix tokens not pooled, padded queries
    out), so with no repeated query this is the spec's pooling.

    Args:
        q (torch.Tensor): (B, H, N, D) queries.
        num_landmarks (int | tuple): m, as in :func:`mita.mita_attention`.
        grid (tuple | None): None (1-D), (gh, gw) or (gt, gh, gw). Default: None.
        num_prefix_tokens (int): leading tokens not pooled. Default: 0.
        num_suffix_tokens (int): trailing tokens not pooled. Default: 0.
        query_padding_mask (torch.Tensor | None): (B, N) bool, True = real query. Default: None.

    Returns:
        (B, H, m, D) landmarks in q's dtype, for ``mita_attention(..., landmarks=...)``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a (B, H, N, D) tensor, got {getattr(q, 'shape', type(q).__name__)}")
    pooling = check_pooling(num_landmarks, grid, num_prefix_tokens, q.shape[2], num_suffix_tokens=num_suffix_tokens)
    return distinct_pool(q, pooling, query_padding_mask)
