"""Landmarks by content: MiTA's pooling with each distinct query vector counted once.

The spec pools the queries of each bin with equal weights (spec section 2, step 1), so a token
repeated across a bin (filler, padding, a uniform image region) makes the bin's landmark its
copy, whatever the few other tokens hold: the landmarks become near one vector, their experts
alike, and routing carries no information (issue 31; ``docs/recall.md``). Here each query is
weighted by 1 / (its copies in the sequence): a bin's landmark is the mean of its *distinct*
queries, and a bin of one repeated token alone still pools to that token.

Give the result to :func:`mita.mita_attention` as ``landmarks=``: every implementation
takes it, and the operator is otherwise the spec's. Equal vectors (within a relative
:data:`DUP_TOL`) are found in O(N log N) per head (:func:`duplicate_groups`), never with an
N x N matrix; the weights are constants (no gradient), the pooled queries carry it.
"""

from __future__ import annotations

import torch

from ..pooling import check_pooling, pool

__all__ = ["DUP_TOL", "distinct_landmarks", "duplicate_groups"]

#: relative distance under which two vectors count as one
DUP_TOL = 1e-5


@torch.no_grad()
def duplicate_groups(x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of equal vectors along the token axis of x (B, H, N, D).

    Vectors are sorted by a fixed projection (equal vectors project equally, so they are
    adjacent, lowest index first) and neighbours closer than :data:`DUP_TOL` times the larger
    norm are one group.

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
    xf = x.float().masked_fill(~real[..., None], 0)
    direction = torch.cos(torch.arange(D, device=x.device, dtype=torch.float32) * 1.3 + 0.5)  # fixed: no RNG drawn
    order = (xf @ direction).masked_fill(~real, float("inf")).argsort(dim=-1, stable=True)
    xs = xf.gather(2, order[..., None].expand(-1, -1, -1, D))
    rs = real.gather(2, order)
    norm = xs.norm(dim=-1)
    close = (xs[..., 1:, :] - xs[..., :-1, :]).norm(dim=-1) <= DUP_TOL * torch.maximum(norm[..., 1:], norm[..., :-1])
    same = torch.cat([torch.zeros_like(rs[..., :1]), close & rs[..., 1:] & rs[..., :-1]], -1)
    group = (~same).long().cumsum(-1) - 1
    size = torch.zeros(B, H, N, device=x.device).scatter_add(2, group, rs.float())
    copies = torch.empty(B, H, N, device=x.device).scatter(2, order, torch.where(rs, size.gather(2, group), 1.0))
    first = torch.empty_like(rs).scatter(2, order, ~same & rs)
    return copies, first


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
    weighted by 1 / (copies of that query in the sequence).

    The bins are the spec's (1-D, 2-D or 3-D, prefix and suffix tokens not pooled, padded queries
    out), so with no repeated query this is the spec's pooling. Args as :func:`mita.mita_attention`:
    q (B, H, N, D); num_landmarks m (an int, or a grid's bins); grid, num_prefix_tokens,
    num_suffix_tokens; query_padding_mask (B, N) bool, True = real query. Default: 1-D, none.

    Returns:
        (B, H, m, D) landmarks in q's dtype, for ``mita_attention(..., landmarks=...)``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a (B, H, N, D) tensor, got {getattr(q, 'shape', type(q).__name__)}")
    pooling = check_pooling(num_landmarks, grid, num_prefix_tokens, q.shape[2], num_suffix_tokens=num_suffix_tokens)
    copies, _ = duplicate_groups(q.detach(), query_padding_mask)
    weight = (1.0 / copies)[..., None]
    pooled = pool(q.float() * weight, pooling, query_padding_mask) / pool(weight, pooling, query_padding_mask)
    return pooled.to(q.dtype)
