"""Standard softmax attention (PyTorch's SDPA) behind the registry's op interface."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import checked_inputs, zero_padded


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
    """``F.scaled_dot_product_attention`` behind the registry's op interface.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): dropout on the attention probabilities. Default: 0.0.
        is_causal (bool): causal attention (Nq == Nk). Default: False.
        scale (float | None): logit scale, positive and finite. Default: D**-0.5.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    # SDPA adds -inf to a padded key's logit and weighs its value by 0: a NaN or inf there (k or v)
    # still makes NaN, and a padded query's NaN row makes NaN gradients for every key: zeroed first.
    args, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    if mask is not None and is_causal:  # SDPA takes one or the other: combine them
        mask = mask & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        is_causal = False
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    return zero_padded(out, args)
