"""``NSAAttention``: timm's ``Attention`` with bidirectional native sparse attention (Yuan et al. 2025)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..ops.checks import check_int
from ..ops.nsa import block_means, key_blocks, nsa_attention
from .base import AttentionLayer

COMPRESSIONS = ("mean", "mlp")


class BlockCompressor(nn.Module):
    """The paper's learned compression phi of one block of keys (or values) to one token.

    phi(block) = mean(block) + W2 GELU(W1 flatten(block + pos) + b1) + b2, over the block's real
    rows (padded rows read as zero), pos a learned intra-block position embedding (block_size, D).
    NSA's phi is an MLP with intra-block positions; the mean beside it is this library's choice: W2
    and b2 start at zero, so a new layer compresses by block means exactly (as ``compression="mean"``)
    and training learns the rest. Shared by the heads.

    Args:
        block_size (int): rows per block.
        head_dim (int): D; the hidden layer has D units too.
    """

    def __init__(self, block_size: int, head_dim: int, **dd: Any) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.empty(block_size, head_dim, **dd))
        self.fc1 = nn.Linear(block_size * head_dim, head_dim, **dd)
        self.fc2 = nn.Linear(head_dim, head_dim, **dd)
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, blocks: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, nb, block_size, D) blocks and their real slots (B, nb, block_size) -> (B, Hkv, nb, D)."""
        keep = real[:, None, :, :, None].to(blocks.dtype)
        blocks = blocks * keep
        hidden = self.fc1((blocks + self.pos * keep).flatten(-2))
        return block_means(blocks, real) + self.fc2(nn.functional.gelu(hidden))


class NSAAttention(AttentionLayer):
    """Bidirectional NSA (:func:`mita.ops.nsa.nsa_attention`); a drop-in for timm's ``Attention``.

    The three branches are mixed by gates computed from the layer's input as in the paper,
    g = sigmoid(x W_g + b_g), one gate per branch and head (``gate_proj``: dim -> 3 H, one
    linear layer as the paper's MLP). It adds parameters: a timm state dict loads with
    ``strict=False``, missing only ``gate_proj`` (and ``compress_k``, ``compress_v`` with
    ``compression="mlp"``).

    Args (besides timm's):
        block_size (int): keys per block (compression and selection). Default: 64.
        topk (int): blocks selected per query. Default: 4.
        window (int): the sliding window's reach (keys at distance <= window). Default: 64.
        chunk_size (int | None): queries per chunk of the op. Default: None.
        compression (str): how a block of keys (and of values) becomes one token: "mean" (the op's
            block mean) or "mlp" (the paper's learned compression, :class:`BlockCompressor`, one for
            keys and one for values). Default: "mean".
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        block_size: int = 64,
        topk: int = 4,
        window: int = 64,
        chunk_size: int | None = None,
        compression: str = "mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        self.block_size, self.topk = check_int("block_size", block_size), check_int("topk", topk)
        self.window = check_int("window", window, 0)
        self.chunk_size = None if chunk_size is None else check_int("chunk_size", chunk_size)
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.compression = compression
        self.gate_proj = nn.Linear(dim, 3 * num_heads, **self.dd)
        if compression == "mlp":
            self.compress_k = BlockCompressor(self.block_size, self.head_dim, **self.dd)
            self.compress_v = BlockCompressor(self.block_size, self.head_dim, **self.dd)
        self._gates: torch.Tensor | None = None  # (B, H, N, 3) of the running forward

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, topk={self.topk}, window={self.window}, compression={self.compression}"

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            B, N, _ = x.shape
            self._gates = torch.sigmoid(self.gate_proj(x)).view(B, N, self.num_heads, 3).transpose(1, 2)
        try:
            return super().forward(x, attn_mask, is_causal, rope=rope)
        finally:
            self._gates = None

    def attend(self, q, k, v, key_padding_mask, is_causal):
        compressed = None
        if self.compression == "mlp":
            real = key_padding_mask if key_padding_mask is not None else k.new_ones(k.shape[0], k.shape[2], dtype=bool)
            compressed = tuple(
                phi(*key_blocks(t, real, self.block_size)) for phi, t in ((self.compress_k, k), (self.compress_v, v))
            )
        return nsa_attention(
            q,
            k,
            v,
            block_size=self.block_size,
            topk=self.topk,
            window=self.window,
            gates=self._gates,
            compressed=compressed,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
            chunk_size=self.chunk_size,
        )
