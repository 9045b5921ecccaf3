"""``TTTLinearAttention`` and ``TTTMLPAttention``: timm's ``Attention`` with bidirectional TTT-Linear and TTT-MLP
(Sun et al. 2024; bidirectional as in ViT^3, Han et al. 2025)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..ops.checks import check_int
from ..ops.ttt import check_inner_lr, ttt_linear_attention
from ..ops.ttt_mlp import ttt_mlp_attention
from .base import AttentionLayer


class InnerModel(nn.Module):
    """The inner linear model's initial weights W_0, one D x D matrix per head (normal, std 0.02, as in TTT-Linear)."""

    def __init__(self, num_heads: int, head_dim: int, dd: dict) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_heads, head_dim, head_dim, **dd) * 0.02)

    def initial(self) -> dict[str, torch.Tensor]:
        """The op's arguments for the initial model."""
        return {"initial_weight": self.weight}


class InnerMLP(nn.Module):
    """The inner MLP's initial weights per head, W1 (D x 4D) and W2 (4D x D), normal with std 0.02 (as in TTT-MLP)."""

    def __init__(self, num_heads: int, head_dim: int, dd: dict) -> None:
        super().__init__()
        self.weight1 = nn.Parameter(torch.randn(num_heads, head_dim, 4 * head_dim, **dd) * 0.02)
        self.weight2 = nn.Parameter(torch.randn(num_heads, 4 * head_dim, head_dim, **dd) * 0.02)

    def initial(self) -> dict[str, torch.Tensor]:
        """The op's arguments for the initial model."""
        return {"weight1": self.weight1, "weight2": self.weight2}


class TTTAttention(AttentionLayer):
    """A bidirectional TTT layer: its op with the learned initial inner model (``inner``, per head).

    The inner model's weights are new parameters: a timm state dict loads with ``strict=False``,
    missing only ``inner``. A subclass names its op, its inner model and its default learning rate.

    Args (besides timm's):
        inner_lr (float | None): the inner learning rate, >= 0; None takes the method's default
            (``default_inner_lr``). Default: None.
        mini_batch_size (int | None): keys per inner step; None: one full-batch step (ViT^3's). Default: None.
    """

    op: Callable[..., torch.Tensor]
    inner_model: type[InnerModel | InnerMLP]
    default_inner_lr: float

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        inner_lr: float | None = None,
        mini_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        self.inner_lr = check_inner_lr(self.default_inner_lr if inner_lr is None else inner_lr)
        self.mini_batch_size = None if mini_batch_size is None else check_int("mini_batch_size", mini_batch_size)
        self.inner = self.inner_model(num_heads, self.head_dim, self.dd)

    def extra_repr(self) -> str:
        return f"inner_lr={self.inner_lr}, mini_batch_size={self.mini_batch_size}"

    def attend(self, q, k, v, key_padding_mask, is_causal):
        return type(self).op(
            q,
            k,
            v,
            inner_lr=self.inner_lr,
            mini_batch_size=self.mini_batch_size,
            **self.inner.initial(),
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
        )


class TTTLinearAttention(TTTAttention):
    """Bidirectional TTT-Linear (:func:`mita.ops.ttt.ttt_linear_attention`); a drop-in for timm's ``Attention``.

    The inner model's initial weights W_0 (``inner``: one D x D matrix per head) are learned;
    ``inner_lr`` defaults to 1.0 (ViT^3's). Options: :class:`TTTAttention`'s.
    """

    op = staticmethod(ttt_linear_attention)
    inner_model = InnerModel
    default_inner_lr = 1.0


class TTTMLPAttention(TTTAttention):
    """Bidirectional TTT-MLP (:func:`mita.ops.ttt_mlp.ttt_mlp_attention`); a drop-in for timm's ``Attention``.

    The inner MLP's initial weights W1, W2 (``inner``: per head, hidden width 4 x head_dim) are
    learned; ``inner_lr`` defaults to 0.1 (Sun et al.'s base rate for TTT-MLP). Options:
    :class:`TTTAttention`'s.
    """

    op = staticmethod(ttt_mlp_attention)
    inner_model = InnerMLP
    default_inner_lr = 0.1
