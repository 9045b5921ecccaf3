"""Standard softmax attention (PyTorch's SDPA) behind the registry's op interface."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import check_attention
from .tiling import zero_padded


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a bool key padding mask (B, Nk); padded query rows are zero."""
    args = check_attention(
        q,
        k,
        v,
        key_padding_mask=key_padding_mask,
        query_padding_mask=query_padding_mask,
        dropout_p=dropout_p,
        scale=scale,
    )
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    if mask is not None and is_causal:  # SDPA takes one or the other: combine them
        mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        is_causal = False
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    return zero_padded(out, args)
