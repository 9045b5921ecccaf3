"""``TTTLinearAttention``: timm's ``Attention`` with bidirectional TTT-Linear (Sun et al. 2024; ViT^3 2025)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..ops.checks import check_int
from ..ops.ttt import check_inner_lr, ttt_linear_attention
from .base import AttentionLayer


class InnerModel(nn.Module):
    """The inner linear model's initial weights W_0, one D x D matrix per head (normal, std 0.02, as in TTT-Linear)."""

    def __init__(self, num_heads: int, head_dim: int, dd: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_heads, head_dim, head_dim, **dd) * 0.02)


class TTTLinearAttention(AttentionLayer):
    """Bidirectional TTT-Linear (:func:`mita.ops.ttt.ttt_linear_attention`); a drop-in for timm's ``Attention``.

    The inner model's initial weights W_0 are learned (``inner``: one D x D matrix per head).
    They are new parameters: a timm state dict loads with ``strict=False``, missing only ``inner``.

    Args (besides timm's):
        inner_lr (float): the inner learning rate, >= 0. Default: 1.0 (ViT^3's).
        mini_batch_size (int | None): keys per inner step; None: one full-batch step (ViT^3's). Default: None.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        inner_lr: float = 1.0,
        mini_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        self.inner_lr = check_inner_lr(inner_lr)
        self.mini_batch_size = None if mini_batch_size is None else check_int("mini_batch_size", mini_batch_size)
        dd = self.dd
        self.inner = InnerModel(num_heads, self.head_dim, dd)

    def extra_repr(self) -> str:
        return f"inner_lr={self.inner_lr}, mini_batch_size={self.mini_batch_size}"

    def attend(self, q, k, v, key_padding_mask, is_causal):
        return ttt_linear_attention(
            q,
            k,
            v,
            inner_lr=self.inner_lr,
            mini_batch_size=self.mini_batch_size,
            initial_weight=self.inner.weight,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
        )
