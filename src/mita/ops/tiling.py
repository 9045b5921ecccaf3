"""Tiling rows by group, for one batched matmul per tile (MiTA's routed experts, MoBA's blocks), and
the zeroing of padded slots (inputs and output rows) every op shares."""

from __future__ import annotations

import torch

from .checks import AttentionArgs, host_readable


def tile_rows(
    group: torch.Tensor, n_groups: int, tile: int | None = None, bound: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Lay rows out in tiles of T rows that each belong to one group.

    ``group`` (R,) holds each row's group in [0, n_groups). Returns ``slot`` (R,), the row's
    place in a buffer of ``len(tile_group) * T`` rows; ``tile_group``, each tile's group;
    and T, ``tile`` or (default) a power of two in [8, 64] near the mean group size. The rows
    of a group are contiguous and padded to a multiple of T: less than T padding rows a
    group, never padding to the busiest group. With ``bound``, or where values are not
    host-readable (CUDA, tracing), the number of tiles is its upper bound, nothing is read
    back to the host, and the spare tiles (at the end, holding no row) repeat the last group.
    """
    R = group.numel()
    T = tile or min(64, max(8, 1 << (max(1, R // n_groups).bit_length() - 1)))
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    bounds = torch.searchsorted(sorted_group, torch.arange(n_groups + 1, device=group.device, dtype=group.dtype))
    counts = bounds.diff()
    tiles = (counts + T - 1) // T
    tile_end = tiles.cumsum(0)
    rank = torch.arange(R, device=group.device) - bounds[:-1][sorted_group]
    slot = torch.empty_like(order).scatter_(0, order, ((tile_end - tiles) * T)[sorted_group] + rank)
    n_tiles = int(tile_end[-1]) if host_readable(group) and not bound else min(R, (R + n_groups * (T - 1)) // T)
    tile_group = torch.searchsorted(tile_end, torch.arange(n_tiles, device=group.device), right=True)
    return slot, tile_group.clamp_(max=n_groups - 1), T


def zero_padding(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero the padded queries, keys and values, as every op's first step.

    Whatever a padded slot holds (NaN, inf, uninitialised memory) must reach no product:
    a zero weight does not stop it (NaN * 0 = NaN, inf * 0 = NaN), in the forward (pooling
    weights, probabilities) or the backward (a zero gradient times the slot). ``masked_fill``
    also gives the padded slots zero gradient. O(N D), no host synchronisation.
    """
    if cfg.key_mask is not None:
        k = k.masked_fill(~cfg.key_mask[:, None, :, None], 0)
        v = v.masked_fill(~cfg.key_mask[:, None, :, None], 0)
    if cfg.query_mask is not None:
        q = q.masked_fill(~cfg.query_mask[:, None, :, None], 0)
    return q, k, v


def zero_padded(out: torch.Tensor, cfg: AttentionArgs) -> torch.Tensor:
    """Output rows of padded queries (the query mask, or the key mask in self-attention) are zero."""
    return out if cfg.query_mask is None else out.masked_fill(~cfg.query_mask[:, None, :, None], 0)
