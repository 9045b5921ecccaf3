"""``OpAttention``: a timm-compatible layer around any attention op (B, H, N, D) -> (B, H, N, D)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..ops.checks import check_int, check_scale
from .base import AttentionLayer

#: the constructor arguments of :class:`AttentionLayer` (timm's), told apart from the op's options
LAYER_ARGS = frozenset(list(inspect.signature(AttentionLayer.__init__).parameters)[1:])
#: the op arguments the layer passes on every call, never options
CALL_ARGS = frozenset({"q", "k", "v", "key_padding_mask", "query_padding_mask", "dropout_p", "is_causal"})


def _optional_int(name: str, value: object) -> int | None:
    return None if value is None else check_int(name, value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


#: construction-time checks of the options the ops share, by name: the checks each op runs per call
OPTION_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "topk": check_int,
    "block_size": check_int,
    "num_landmarks": check_int,
    "chunk_size": _optional_int,
    "pinv_iterations": _optional_int,
    "scale": check_scale,
    "causal": _flag,
}


def op_options(op: Callable[..., torch.Tensor]) -> list[str]:
    """The options of ``op`` a layer can bind: its keyword arguments but for the tensors and per-call ones."""
    params = inspect.signature(op).parameters.values()
    return sorted(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in CALL_ARGS)


class OpAttention(AttentionLayer):
    """A timm-compatible layer around ``op``; ``options`` (the op's keyword arguments) can be changed after building.

    Args:
        dim (int): token width C of the input (B, N, C).
        num_heads (int): attention heads. Default: 8.
        op (Callable): ``op(q, k, v, *, key_padding_mask=None, dropout_p=0., **options)`` on (B, H, N, D).
        name (str): the method's name, for ``repr`` and errors. Default: the op's name.
        **kwargs: timm's ``Attention`` arguments (``qkv_bias``, ``attn_drop``, ...), the rest are ``options``,
            checked here as the op checks them (options changed later are checked by the op per call).
    """

    def __init__(
        self, dim: int, num_heads: int = 8, *args: Any, op: Callable[..., torch.Tensor], name: str = "", **kwargs: Any
    ) -> None:
        base = {k: kwargs.pop(k) for k in list(kwargs) if k in LAYER_ARGS}
        super().__init__(dim, num_heads, *args, **base)
        self.attention = name or op.__name__
        accepted = op_options(op)
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ValueError(f"attention {self.attention!r} takes no options {unknown}; its options: {accepted}")
        self.options = {k: OPTION_CHECKS[k](k, v) if k in OPTION_CHECKS else v for k, v in kwargs.items()}
        self.op = op

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
