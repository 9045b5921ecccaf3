"""``OpAttention``: a timm-compatible layer around any attention op (B, H, N, D) -> (B, H, N, D)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .base import AttentionLayer

#: the constructor arguments of :class:`AttentionLayer` (timm's), told apart from the op's options
_LAYER_ARGS = frozenset(list(inspect.signature(AttentionLayer.__init__).parameters)[1:])


class OpAttention(AttentionLayer):
    """A timm-compatible layer around ``op``; ``options`` (the op's keyword arguments) can be changed after building.

    Args:
        dim (int): token width C of the input (B, N, C).
        num_heads (int): attention heads. Default: 8.
        op (Callable): ``op(q, k, v, *, key_padding_mask=None, dropout_p=0., **options)`` on (B, H, N, D).
        name (str): the method's name, for ``repr``. Default: the op's name.
        **kwargs: timm's ``Attention`` arguments (``qkv_bias``, ``attn_drop``, ...), the rest are ``options``.
    """

    def __init__(
        self, dim: int, num_heads: int = 8, *args: Any, op: Callable[..., torch.Tensor], name: str = "", **kwargs: Any
    ) -> None:
        base = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAYER_ARGS}
        super().__init__(dim, num_heads, *args, **base)
        self.attention, self.options, self.op = name or op.__name__, kwargs, op

    def extra_repr(self) -> str:
        return f"attention={self.attention!r}, options={self.options}"

    def attend(self, q, k, v, key_padding_mask, is_causal):
        extra = {"is_causal": True} if is_causal else {}
        if "query_padding_mask" in inspect.signature(self.op).parameters:  # self-attention: the queries are the keys
            extra["query_padding_mask"] = key_padding_mask
        return self.op(q, k, v, key_padding_mask=key_padding_mask, dropout_p=self.dropout_p, **extra, **self.options)

    @property
    def supports_causal(self) -> bool:  # type: ignore[override]
        """Whether the op takes ``is_causal`` (SDPA, top-k, MoBA, linear attention)."""
        return "is_causal" in inspect.signature(self.op).parameters
