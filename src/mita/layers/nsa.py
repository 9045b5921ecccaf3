"""``NSAAttention``: timm's ``Attention`` with bidirectional native sparse attention (Yuan et al. 2025)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..ops.checks import check_int
from ..ops.nsa import nsa_attention
from .base import AttentionLayer


class NSAAttention(AttentionLayer):
    """Bidirectional NSA (:func:`mita.ops.nsa.nsa_attention`); a drop-in for timm's ``Attention``.

    The three branches are mixed by gates computed from the layer's input as in the paper,
    g = sigmoid(x W_g + b_g), one gate per branch and head (``gate_proj``: dim -> 3 H, one
    linear layer as the paper's MLP). It adds parameters: a timm state dict loads with
    ``strict=False``, missing only ``gate_proj``.

    Args (besides timm's):
        block_size (int): keys per block (compression and selection). Default: 64.
        topk (int): blocks selected per query. Default: 4.
        window (int): the sliding window's reach (keys at distance <= window). Default: 64.
        chunk_size (int | None): queries per chunk of the op. Default: None.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        self.block_size, self.topk = check_int("block_size", block_size), check_int("topk", topk)
        self.window = check_int("window", window, 0)
        self.chunk_size = None if chunk_size is None else check_int("chunk_size", chunk_size)
        self.gate_proj = nn.Linear(dim, 3 * num_heads, **self.dd)
        self._gates: torch.Tensor | None = None  # (B, H, N, 3) of the running forward

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, topk={self.topk}, window={self.window}"

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
        return nsa_attention(
            q,
            k,
            v,
            block_size=self.block_size,
            topk=self.topk,
            window=self.window,
            gates=self._gates,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
            chunk_size=self.chunk_size,
        )
