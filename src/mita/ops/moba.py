"""MoBA, Mixture of Block Attention (Lu et al. 2025).

The keys are cut into fixed blocks of ``block_size`` tokens (the last one may be short);
each query attends to the ``topk`` blocks whose mean key has the largest dot product
with it. Causal: future blocks are never chosen, the query's own block always is (and
is masked causally inside). The blocks are experts built by position (a locality prior);
the routing is N-to-N/n. The reference builds the full (Nq, Nk) mask. The efficient path
lays the (query, selected block) pairs out grouped by block, in tiles of T queries that
share one block, so the scores and the weighted values are one batched matmul each over
(tiles, T, D) x (tiles, D, block_size): memory O(N x topk x block_size), linear in N for
a fixed number of selected blocks, and queries are taken in chunks if that is large.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import (
    check_causal,
    check_positive_int,
    checked_inputs,
    chunk_rows,
    key_mask_of,
    masked_attention,
    softmax_allowed,
    zero_padded,
)
from .tiling import tile_rows


def _route(affinity: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor, block_size: int, causal: bool, topk: int):
    """Selected blocks (..., rows, n_sel) of each query and whether each selection is real.

    Empty blocks (all keys padded) and, if causal, future blocks are never chosen; with
    ``causal`` the query's own block always is.
    """
    affinity = affinity.masked_fill(~valid[:, None, None, :], float("-inf"))
    if causal:
        blocks = torch.arange(affinity.shape[-1], device=affinity.device)
        own = (rows // block_size)[:, None]
        affinity = affinity.masked_fill(blocks > own, float("-inf")).masked_fill(blocks == own, float("inf"))
    chosen, blocks = affinity.topk(min(topk, affinity.shape[-1]), dim=-1)
    return blocks, chosen > float("-inf")


def _check(q, k, v, block_size, topk, key_padding_mask, query_padding_mask, dropout_p, scale, causal, is_causal):
    """Checked arguments, the causal flag, and q, k, v with padded slots zero.

    Zeroed, not weighted by the mask: a zero weight times NaN or inf is NaN, in a block mean
    (which then routes every query wrongly) as in a value weighed by probability 0.
    """
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    check_positive_int("block_size", block_size)
    check_positive_int("topk", topk)
    return cfg, check_causal(causal, is_causal, q, k), q, k, v


def moba_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    is_causal: bool = False,
) -> torch.Tensor:
    """MoBA by its definition: block means, block choice per query, dense attention over the chosen keys."""
    cfg, causal, q, k, v = _check(
        q, k, v, block_size, topk, key_padding_mask, query_padding_mask, dropout_p, scale, causal, is_causal
    )
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    real = key_mask_of(cfg, k)
    keys = k.repeat_interleave(H // k.shape[1], dim=1)
    means, valid = [], []
    for start in range(0, Nk, block_size):  # mean of the real keys of each block (padded keys are zero)
        count = real[:, start : start + block_size].sum(1)
        means.append(keys[:, :, start : start + block_size].sum(2) / count.clamp(min=1)[:, None, None])
        valid.append(count > 0)
    rows = torch.arange(Nq, device=q.device)
    blocks, ok = _route(
        q @ torch.stack(means, 2).transpose(-1, -2), torch.stack(valid, 1), rows, block_size, causal, topk
    )
    chosen = torch.zeros(B, H, Nq, len(means), dtype=torch.bool, device=q.device).scatter(-1, blocks, ok)
    allowed = chosen[..., torch.arange(Nk, device=q.device) // block_size] & real[:, None, None, :]
    if causal:
        allowed = allowed & (torch.arange(Nk, device=q.device) <= rows[:, None])
    return zero_padded(masked_attention(q, k, v, allowed, cfg.scale, dropout_p), cfg)


def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    is_causal: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """MoBA on (B, H, N, D) tensors in memory linear in N.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        block_size (int): keys per block.
        topk (int): blocks per query, clamped to the block count; with every block selected this is
            softmax attention.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): dropout on the attention probabilities. Default: 0.0.
        scale (float | None): logit scale, positive and finite. Default: D**-0.5.
        causal (bool): no future blocks; the own block is always selected, causally masked (needs
            Nq == Nk). Default: False.
        is_causal (bool): the same, under SDPA's name (layers pass it). Default: False.
        chunk_size (int | None): queries per chunk; None keeps the chunk's buffers near 2^24 elements. Default: None.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, causal, q, k, v = _check(
        q, k, v, block_size, topk, key_padding_mask, query_padding_mask, dropout_p, scale, causal, is_causal
    )
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, nb, bs = H // Hkv, math.ceil(Nk / block_size), block_size
    pad = nb * bs - Nk
    real = F.pad(key_mask_of(cfg, k), (0, pad), value=False).reshape(B, nb, bs)
    kb = F.pad(k, (0, 0, 0, pad)).reshape(B * Hkv * nb, bs, D)  # row g = (b * Hkv + kv head) * nb + block
    vb = F.pad(v, (0, 0, 0, pad)).reshape(B * Hkv * nb, bs, D)
    count = real.sum(-1)  # (B, nb)
    means = kb.view(B, Hkv, nb, bs, D).sum(3) / count.clamp(min=1)[:, None, :, None]  # padded keys are 0
    n_sel = min(topk, nb)
    step = chunk_rows(Nq, B * H * max(nb, n_sel * max(bs, D)), chunk_size)
    batch = torch.arange(B, device=q.device)[:, None, None, None]
    offsets = torch.arange(bs, device=q.device)
    kv_head = (torch.arange(B, device=q.device)[:, None] * Hkv + torch.arange(H, device=q.device) // G) * nb
    outs = []
    for start in range(0, Nq, step):
        rows = torch.arange(start, min(start + step, Nq), device=q.device)
        C = rows.numel()
        qc = q[:, :, start : start + C]
        affinity = (qc.reshape(B, Hkv, G * C, D) @ means.transpose(-1, -2)).view(B, H, C, nb)
        blocks, ok = _route(affinity, count > 0, rows, bs, causal, topk)  # (B, H, C, n_sel)
        # One row per (query, selected block), grouped by block into tiles of T rows.
        slot, tile_block, T = tile_rows((kv_head[:, :, None, None] + blocks).reshape(-1), B * Hkv * nb)
        n_rows = tile_block.numel() * T
        q_rows = qc.unsqueeze(3).expand(B, H, C, n_sel, D).reshape(-1, D)
        q_t = q.new_zeros(n_rows, D).index_put((slot,), q_rows).view(-1, T, D)
        scores = (q_t @ kb[tile_block].transpose(1, 2)).view(n_rows, bs)[slot].view(B, H, C, n_sel * bs)
        allowed = (real[batch, blocks] & ok[..., None]).flatten(-2)
        if causal:
            allowed = allowed & ((blocks[..., None] * bs + offsets).flatten(-2) <= rows[:, None])
        p = softmax_allowed(cfg.scale * scores, allowed)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        p_t = q.new_zeros(n_rows, bs).index_put((slot,), p.reshape(-1, bs)).view(-1, T, bs)
        outs.append((p_t @ vb[tile_block]).view(n_rows, D)[slot].view(B, H, C, n_sel, D).sum(3))
    return zero_padded(torch.cat(outs, dim=2), cfg)


def moba_flops(n: int, d: int, block_size: int = 64, topk: int = 2, **_: object) -> float:
    """Block affinities (2 N (N/b) D) plus attention over k blocks of b keys (4 N k b D)."""
    nb = math.ceil(n / block_size)
    return 2 * n * nb * d + 4 * n * min(topk, nb) * block_size * d
