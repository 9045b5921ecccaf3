"""Efficient MiTA attention: linear memory, queries grouped by routed expert.

Nothing of size Nq x Nk is built. Every (query, routed expert) pair gets a row in a
buffer where the rows of one expert are contiguous and padded to a multiple of a tile
size T, so the routed scores and values become one batched matmul of
(tiles, T, D) x (tiles, D, k) with no padding to the busiest expert. The joint softmax
over the shared expert and the s routed experts is taken in the per-query layout.
Pure PyTorch and device-agnostic; autograd gives the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MiTAConfig


def pooling_matrix(n: int, m: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(m, n) averaging weights with the bin edges of ``adaptive_avg_pool1d``."""
    i = torch.arange(m, device=device)
    start = (i * n) // m
    end = ((i + 1) * n + m - 1) // m
    t = torch.arange(n, device=device)
    w = ((t >= start[:, None]) & (t < end[:, None])).to(dtype)
    return w / (end - start).to(dtype)[:, None]


def pool_landmarks(q: torch.Tensor, cfg: MiTAConfig) -> torch.Tensor:
    """Step 1 in O(m N D) per head: average-pool the queries after the prefix (B, H, m, D)."""
    x = q[:, :, cfg.num_prefix_tokens :]
    L = x.shape[2]
    real = None if cfg.query_mask is None else cfg.query_mask[:, cfg.num_prefix_tokens :]
    if cfg.grid is None:
        if real is None:
            if L % cfg.m == 0:
                return x.unflatten(2, (cfg.m, L // cfg.m)).mean(3)
            return pooling_matrix(L, cfg.m, q.device, q.dtype) @ x
        # 1-D bins over each sequence's real tokens: bin of a token = bins of its rank.
        n_real = real.sum(1)  # (B,)
        rank = real.cumsum(1) - 1  # (B, L)
        i = torch.arange(cfg.m, device=q.device)
        start = (i[None] * n_real[:, None]) // cfg.m  # (B, m)
        end = ((i[None] + 1) * n_real[:, None] + cfg.m - 1) // cfg.m
        w = (rank[:, None] >= start[..., None]) & (rank[:, None] < end[..., None]) & real[:, None]
        w = w.to(q.dtype) / (end - start).to(q.dtype)[..., None]  # (B, m, L)
        return w[:, None] @ x
    (gh, gw), (mh, mw) = cfg.grid, cfg.pool_shape
    w = torch.kron(pooling_matrix(gh, mh, q.device, q.dtype), pooling_matrix(gw, mw, q.device, q.dtype))
    if real is None:
        return w @ x
    w = w[None] * real[:, None].to(q.dtype)  # (B, m, L): mean over the real tokens of each bin
    den = w.sum(-1, keepdim=True)
    if bool((den == 0).any()):
        raise ValueError("key_padding_mask leaves a 2-D landmark bin with no real token")
    return (w / den)[:, None] @ x


def _tile_size(rows: int, groups: int) -> int:
    """Tile height: the power of two near the mean group size, in [8, 64]."""
    mean = max(1, rows // max(groups, 1))
    return int(min(64, max(8, 1 << (mean.bit_length() - 1))))


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
    if cfg.key_mask is not None:
        k = k.masked_fill(~cfg.key_mask[:, None, :, None], 0)
        v = v.masked_fill(~cfg.key_mask[:, None, :, None], 0)
    if cfg.query_mask is not None:
        q = q.masked_fill(~cfg.query_mask[:, None, :, None], 0)
    acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    if landmarks is None:
        landmarks = pool_landmarks(q, cfg)
    # Affinities with the query heads of one kv head stacked: (B, Hkv, G*m, Nk).
    A = landmarks.reshape(B, Hkv, G * m, D) @ k.transpose(-1, -2)
    if cfg.key_mask is not None:
        A = A.masked_fill(~cfg.key_mask[:, None, None, :], float("-inf"))
    v_shared = (torch.softmax(cfg.scale * A, dim=-1, dtype=acc).to(q.dtype) @ v).view(B, H, m, D)
    experts = A.topk(kk, dim=-1).indices.view(B, H, m, kk)

    gate = q @ landmarks.transpose(-1, -2)  # (B, H, Nq, m): routing gate and shared logits
    routes = gate.topk(s, dim=-1).indices  # (B, H, Nq, s)
    if not cfg.use_routed:  # ablation: the shared expert alone
        p = torch.softmax(cfg.landmark_scale * gate, dim=-1, dtype=acc).to(q.dtype)
        out = F.dropout(p, dropout_p) @ v_shared if dropout_p > 0 else p @ v_shared
        return _zero_padded(out, cfg), (landmarks, experts, routes)

    # Rows of the grouped buffer: one per (query, routed expert), grouped by global expert id.
    expert_id = (routes + torch.arange(X, device=q.device).view(B, H, 1, 1) * m).reshape(-1)
    counts = torch.bincount(expert_id, minlength=X * m)
    T = _tile_size(expert_id.numel(), X * m)
    tiles = (counts + T - 1) // T
    n_tiles = int(tiles.sum())
    order = torch.argsort(expert_id, stable=True)
    first_row = torch.cumsum(counts, 0) - counts
    first_slot = (torch.cumsum(tiles, 0) - tiles) * T
    g_sorted = expert_id[order]
    slot_sorted = first_slot[g_sorted] + torch.arange(order.numel(), device=q.device) - first_row[g_sorted]
    slot = torch.empty_like(order).scatter_(0, order, slot_sorted)  # (X*Nq*s,) row -> slot
    tile_expert = torch.repeat_interleave(torch.arange(X * m, device=q.device), tiles, output_size=n_tiles)

    # Keys and values of each tile's expert, gathered straight from k and v.
    kv_head = (torch.arange(X, device=q.device) // H) * Hkv + (torch.arange(X, device=q.device) % H) // G
    key_row = (experts.view(X, m, kk) + (kv_head * Nk).view(X, 1, 1)).view(X * m, kk)[tile_expert]
    k_t = k.reshape(-1, D)[key_row]  # (tiles, kk, D)
    v_t = v.reshape(-1, D)[key_row]

    q_rows = q.reshape(X * Nq, 1, D).expand(X * Nq, s, D).reshape(-1, D)
    q_t = q.new_zeros(n_tiles * T, D).index_put((slot,), q_rows).view(n_tiles, T, D)
    scores = (q_t @ k_t.transpose(1, 2)).view(n_tiles * T, kk)[slot].view(B, H, Nq, s * kk)
    routed = cfg.scale * scores
    if cfg.short_keys:  # clamped k: slots past a short sequence's real keys
        real = torch.gather(cfg.key_mask[:, None, None, :].expand(B, H, m, Nk), 3, experts)
        real = torch.gather(real.unsqueeze(2).expand(B, H, Nq, m, kk), 3, routes[..., None].expand(-1, -1, -1, -1, kk))
        routed = routed.masked_fill(~real.flatten(3), float("-inf"))

    ms = m if cfg.use_shared else 0
    logits = torch.cat([cfg.landmark_scale * gate, routed], dim=-1) if ms else routed
    p = torch.softmax(logits, dim=-1, dtype=acc).to(q.dtype)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    p_t = q.new_zeros(n_tiles * T, kk).index_put((slot,), p[..., ms:].reshape(-1, kk)).view(n_tiles, T, kk)
    out = (p_t @ v_t).view(n_tiles * T, D)[slot].view(B, H, Nq, s, D).sum(3)
    if ms:
        out = out + p[..., :m] @ v_shared
    return _zero_padded(out, cfg), (landmarks, experts, routes)


def _zero_padded(out: torch.Tensor, cfg: MiTAConfig) -> torch.Tensor:
    """Step 7: the output rows of padded queries are zero."""
    return out if cfg.query_mask is None else out.masked_fill(~cfg.query_mask[:, None, :, None], 0)
