"""``MHLAAttention``: timm's ``Attention`` with MHLA, linear attention over token blocks (Zhang et al., ICLR 2026)."""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from ..ops.mhla import block_mixing, mhla_attention
from .base import AttentionLayer, GridOption, PatchGrid, check_bins, check_grid_option, resolve_grid


class BlockMixing(nn.Module):
    """The learned block mixing M (m, m), initialised with :func:`mita.ops.mhla.block_mixing` on the block layout."""

    def __init__(self, shape: tuple[int, ...], dd: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(block_mixing(shape, **dd))


class MHLAAttention(AttentionLayer):
    """MHLA (:func:`mita.ops.mhla.mhla_attention`); a drop-in for timm's ``Attention``.

    The block mixing M (m, m) is learned (``mixing``, a module), initialised with the authors' cosine
    weights of the block distances (:func:`mita.ops.mhla.block_mixing`), as in the MiTA
    authors' comparison code, where the mixing convolution is initialised so and not frozen.
    It adds parameters: a timm state dict loads with ``strict=False``, missing only ``mixing``.

    Args (besides timm's):
        num_blocks (int | tuple): m; with a 2-D grid, (mh, mw) or a perfect square. Default: 16.
        grid (tuple | str | None): None (runs of the sequence), (gh, gw), (gt, gh, gw), or "auto"
            (a square grid of N - num_prefix_tokens). Default: None.
        num_prefix_tokens (int): leading tokens (CLS) in no block (nor rotated by ``rope``). Default: 0.
        num_suffix_tokens (int): trailing tokens (ViT-5's registers) in no block. Default: 0.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        num_blocks: int | tuple[int, ...] = 16,
        grid: GridOption = None,
        num_prefix_tokens: int = 0,
        num_suffix_tokens: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dim, num_heads, *args, num_prefix_tokens=num_prefix_tokens, num_suffix_tokens=num_suffix_tokens, **kwargs
        )
        self.grid = check_grid_option(grid)
        self.num_blocks = check_bins("num_blocks", num_blocks, self.grid)
        self.patch_grid: PatchGrid | None = None  # the running forward's patch grid (models of varying image size)
        dims = 1 if self.grid is None else 2 if self.grid == "auto" else len(self.grid)
        m = math.prod(self.num_blocks) if isinstance(self.num_blocks, tuple) else self.num_blocks
        shape = self.num_blocks if isinstance(self.num_blocks, tuple) else (round(m ** (1 / dims)),) * dims
        self.mixing = BlockMixing(shape, self.dd)

    def extra_repr(self) -> str:
        return (
            f"num_blocks={self.num_blocks}, grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}, "
            f"num_suffix_tokens={self.num_suffix_tokens}"
        )

    def resolve_grid(self, n: int) -> tuple[int, ...] | None:
        """The grid for a sequence of n tokens: the running forward's patch grid, or ``grid`` ("auto": a square)."""
        return resolve_grid(self.grid, n, self.num_prefix_tokens, self.patch_grid, self.num_suffix_tokens)

    def attend(self, q, k, v, key_padding_mask, is_causal):
        return mhla_attention(
            q,
            k,
            v,
            num_blocks=self.num_blocks,
            grid=self.resolve_grid(q.shape[2]),
            num_prefix_tokens=self.num_prefix_tokens,
            num_suffix_tokens=self.num_suffix_tokens,
            mixing=self.mixing.weight,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
        )
