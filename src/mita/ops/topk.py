"""Query-specific top-k attention: each query keeps its own k largest logits.

Every query is its own expert's router: the taxonomy's "N times one-to-one" routing.
The selection needs all N logits of a query, so the cost stays quadratic in FLOPs,
but :func:`topk_attention` works through the queries in chunks, so memory is
O(chunk x N) instead of O(N^2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import AttentionArgs
from .common import (
    check_causal,
    check_positive_int,
    checked_inputs,
    chunk_rows,
    gather_rows,
    key_mask_of,
    masked_attention,
    softmax_allowed,
    zero_padded,
)


def _allowed_keys(cfg: AttentionArgs, k: torch.Tensor, rows: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1, len(rows), Nk) bool: real keys, and with ``causal`` not after the query row."""
    allowed = key_mask_of(cfg, k)[:, None, None, :]
    if causal:
        allowed = allowed & (torch.arange(k.shape[2], device=k.device) <= rows[:, None])
    return allowed


def topk_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topk: int,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    is_causal: bool = False,
) -> torch.Tensor:
    """Top-k attention with the full (Nq, Nk) logit matrix: keep each row's k largest, softmax, sum."""
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    causal = check_causal(causal, is_causal, q, k)
    kk = min(check_positive_int("topk", topk), k.shape[2])
    rows = torch.arange(q.shape[2], device=q.device)
    allowed = _allowed_keys(cfg, k, rows, causal).expand(*q.shape[:3], k.shape[2])
    logits = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2)
    keep = logits.masked_fill(~allowed, float("-inf")).topk(kk, dim=-1).indices
    kept = torch.zeros_like(allowed).scatter(-1, keep, True) & allowed
    return zero_padded(masked_attention(q, k, v, kept, cfg.scale, dropout_p), cfg)


def topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topk: int,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    is_causal: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Query-specific top-k attention in O(chunk x Nk) memory.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        topk (int): keys each query keeps, clamped to Nk; with topk >= Nk this is softmax attention.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): dropout on the kept keys' probabilities. Default: 0.0.
        scale (float | None): logit scale, positive and finite. Default: D**-0.5.
        causal (bool): a query sees only keys at or before its position (needs Nq == Nk). Default: False.
        is_causal (bool): the same, under SDPA's name (layers pass it). Default: False.
        chunk_size (int | None): queries per chunk; None picks one that bounds the chunk's memory. Default: None.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    # Masking the logits keeps padded keys out of the forward, but not a NaN key out of dq (its
    # logit's zero gradient times it), nor a padded value picked with probability 0 (topk > real keys).
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    causal = check_causal(causal, is_causal, q, k)
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, kk = H // Hkv, min(check_positive_int("topk", topk), Nk)
    step = chunk_rows(Nq, B * H * max(Nk, kk * D), chunk_size)
    outs = []
    for start in range(0, Nq, step):
        rows = torch.arange(start, min(start + step, Nq), device=q.device)
        C = rows.numel()
        qc = q[:, :, start : start + C].reshape(B, Hkv, G * C, D)
        logits = (qc @ k.transpose(-1, -2)).view(B, H, C, Nk)
        masked = cfg.key_mask is not None or causal
        if masked:
            logits = logits.masked_fill(~_allowed_keys(cfg, k, rows, causal), float("-inf"))
        top, idx = logits.topk(kk, dim=-1)
        if masked:  # -inf marks a key not allowed; a row with none (a padded causal query) must stay finite
            kept = top > float("-inf")
            p = softmax_allowed(cfg.scale * top.masked_fill(~kept, 0), kept)
        else:
            p = softmax_allowed(cfg.scale * top, None)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        vals = gather_rows(v, idx.reshape(B, Hkv, G * C * kk)).view(B, H, C, kk, D)
        outs.append((p.unsqueeze(-2) @ vals).squeeze(-2))
    return zero_padded(torch.cat(outs, dim=2), cfg)


def topk_flops(n: int, d: int, topk: int = 64, **_: object) -> float:
    """All N logits per query (2 N^2 D) plus the weighted sum of k values (2 N k D)."""
    return 2 * n * n * d + 2 * n * min(topk, n) * d
