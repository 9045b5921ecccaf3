"""Tiling rows by group, for one batched matmul per tile (MiTA's routed experts, MoBA's blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .mita.config import MiTAConfig


def tile_rows(group: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Lay rows out in tiles of T rows that each belong to one group.

    ``group`` (R,) holds each row's group in [0, n_groups). Returns ``slot`` (R,), the row's
    place in a buffer of ``len(tile_group) * T`` rows; ``tile_group``, each tile's group;
    and T, a power of two in [8, 64] near the mean group size. The rows of a group are
    contiguous and padded to a multiple of T: less than T padding rows a group, never
    padding to the busiest group.
    """
    counts = torch.bincount(group, minlength=n_groups)
    T = int(min(64, max(8, 1 << (max(1, group.numel() // n_groups).bit_length() - 1))))
    tiles = (counts + T - 1) // T
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    rank = torch.arange(group.numel(), device=group.device) - (counts.cumsum(0) - counts)[sorted_group]
    slot = torch.empty_like(order).scatter_(0, order, ((tiles.cumsum(0) - tiles) * T)[sorted_group] + rank)
    n_tiles = int(tiles.sum())
    tile_group = torch.repeat_interleave(torch.arange(n_groups, device=group.device), tiles, output_size=n_tiles)
    return slot, tile_group, T


def zero_padding(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: MiTAConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero the padded queries, keys and values: whatever a padded slot holds (NaN included)
    must not reach a product."""
    if cfg.key_mask is not None:
        k = k.masked_fill(~cfg.key_mask[:, None, :, None], 0)
        v = v.masked_fill(~cfg.key_mask[:, None, :, None], 0)
    if cfg.query_mask is not None:
        q = q.masked_fill(~cfg.query_mask[:, None, :, None], 0)
    return q, k, v


def zero_padded(out: torch.Tensor, cfg: MiTAConfig) -> torch.Tensor:
    """Output rows of padded queries (self-attention with a key padding mask) are zero."""
    return out if cfg.query_mask is None else out.masked_fill(~cfg.query_mask[:, None, :, None], 0)
