"""Efficient MiTA attention: linear memory, queries grouped by routed expert.

Nothing of size Nq x Nk is built. Every (query, routed expert) pair gets a row in a
buffer where the rows of one expert are contiguous and padded to a multiple of a tile
size T (:func:`mita.ops.tiling.tile_rows`), so the routed scores and values are one
batched matmul of (tiles, T, D) x (tiles, D, k), with no padding to the busiest expert.
Step 6's joint softmax is a merge of partial softmaxes: the shared expert's and each
routed expert's outputs, weighted by the softmax of their log-sum-exps. Pure PyTorch and
device-agnostic; the backward of the two softmax pieces is hand-written (``autograd.py``).
"""

from __future__ import annotations

import torch

from ..common import topk_indices
from ..pooling import pool
from ..tiling import tile_rows, zero_padded, zero_padding
from .autograd import SoftmaxLSE, TileAttention
from .config import MiTAConfig


def mita_attention_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: MiTAConfig,
    landmarks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """MiTA attention in linear memory; returns (out, (landmarks, experts, routes))."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, m, kk, s = H // Hkv, cfg.m, cfg.topk, cfg.num_routed
    X = B * H
    q, k, v = zero_padding(q, k, v, cfg)  # padded tokens take no part anywhere
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    if landmarks is None:
        landmarks = pool(q, cfg.pooling, cfg.query_mask)
    # Affinities A with the query heads of one kv head stacked: (B, Hkv, G*m, Nk). Top-k and routing
    # read the unscaled products, as the reference does, so that no scale changes which keys tie.
    A = landmarks.reshape(B, Hkv, G * m, D) @ k.transpose(-1, -2)
    if cfg.key_mask is not None:
        A = A.masked_fill(~cfg.key_mask[:, None, None, :], float("-inf"))
    if cfg.key_offset is not None:  # merged duplicates: a group's first key + log(copies) / s0, the others -inf
        A = A + cfg.key_offset[:, :, None, :].to(A.dtype) / cfg.scale
    v_shared = (torch.softmax(cfg.scale * A.to(acc), dim=-1).to(q.dtype) @ v).view(B, H, m, D)
    experts = topk_indices(A, kk).view(B, H, m, kk)

    # Gate q . q~: routing (the s largest) and, scaled by ls, the shared expert's logits.
    gate = q @ landmarks.transpose(-1, -2)  # (B, H, Nq, m)
    g = gate.detach()
    routes = g.argmax(-1, keepdim=True) if s == 1 else topk_indices(g, s)  # (B, H, Nq, s)
    # Step 6 as a merge of partial softmaxes: the shared expert over the landmarks and each
    # routed expert over its keys give an output and a log-sum-exp each; weighting the
    # outputs by softmax(lse) is exactly the one joint softmax (repeated keys counted).
    p_sh, lse_sh = SoftmaxLSE.apply(cfg.landmark_scale * gate.to(acc), acc)
    lse_sh = lse_sh.unsqueeze(-1)  # (B, H, Nq, 1)
    out_sh = _drop(p_sh.to(q.dtype), dropout_p) @ v_shared  # (B, H, Nq, D)
    if not cfg.use_routed:  # ablation: the shared expert alone
        return zero_padded(out_sh, cfg), (landmarks, experts, routes)

    # Rows of the grouped buffer: one per (query, routed expert), grouped by global expert id.
    expert_id = (routes + torch.arange(X, device=q.device).view(B, H, 1, 1) * m).reshape(-1)
    slot, tile_expert, T = tile_rows(expert_id, X * m)
    n_tiles = tile_expert.numel()
    # The query row of every slot; padding slots repeat the first query of their own head,
    # so that nothing crosses batch elements (their outputs are never read).
    slot_row = (
        (tile_expert // m * Nq)
        .repeat_interleave(T)
        .index_copy(0, slot, torch.arange(slot.numel(), device=q.device).div(s, rounding_mode="floor"))
    )
    q_t = q.reshape(-1, D).index_select(0, slot_row).view(n_tiles, T, D)
    # Rows of each tile's expert keys in k and v flattened (kv head of query head x).
    x = torch.arange(X, device=q.device)
    kv_head = (x // H) * Hkv + (x % H) // G
    key_row = (experts.view(X, m, kk) + (kv_head * Nk).view(X, 1, 1)).view(X * m, kk)[tile_expert].view(-1)
    k_t = k.reshape(-1, D).index_select(0, key_row).view(n_tiles, kk, D)
    v_t = v.reshape(-1, D).index_select(0, key_row).view(n_tiles, kk, D)

    real = bias = None
    if cfg.short_keys:  # clamped k: slots past a short sequence's real keys
        real = cfg.key_mask.reshape(-1)[(key_row // (Hkv * Nk)) * Nk + key_row % Nk].view(n_tiles, kk)
    if cfg.key_offset is not None:  # merged duplicates: each slot's log(copies), -inf past the distinct keys
        bias = cfg.key_offset.reshape(-1).index_select(0, key_row).view(n_tiles, kk).to(acc)
    # (tiles, T, D), (tiles, T)
    out_t, lse_t = TileAttention.apply(q_t, k_t, v_t, real, bias, cfg.scale, dropout_p, acc)
    out_r = out_t.view(-1, D).index_select(0, slot).view(B, H, Nq, s, D)
    lse_r = lse_t.view(-1).index_select(0, slot).view(B, H, Nq, s)
    if not cfg.use_shared:
        out = (torch.softmax(lse_r, -1).to(q.dtype).unsqueeze(-2) @ out_r).squeeze(-2)
    elif s == 1:  # weight of the routed part: sigmoid(lse_r - lse_shared)
        out = torch.lerp(out_sh, out_r.squeeze(3), torch.sigmoid(lse_r - lse_sh).to(q.dtype))
    else:
        w = torch.softmax(torch.cat([lse_sh, lse_r], -1), -1).to(q.dtype)  # (B, H, Nq, 1 + s)
        out = torch.addcmul((w[..., 1:].unsqueeze(-2) @ out_r).squeeze(-2), w[..., :1], out_sh)
    return zero_padded(out, cfg), (landmarks, experts, routes)


def _drop(p: torch.Tensor, dropout_p: float) -> torch.Tensor:
    return torch.nn.functional.dropout(p, dropout_p) if dropout_p > 0 else p
