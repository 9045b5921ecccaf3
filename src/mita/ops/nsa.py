"""Native sparse attention, bidirectional (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned
and Natively Trainable Sparse Attention", arXiv 2502.11089).

Three branches over the keys, each a softmax attention, mixed by gates:
out = g_cmp o_cmp + g_slc o_slc + g_win o_win.

- compression: the keys are cut into blocks of ``block_size`` (the last may be short) and each
  block is compressed to one token: by default the mean of its real keys and values, or the
  tokens passed as ``compressed`` (the paper's learned MLP with intra-block positions is the
  layer's ``compression="mlp"``); blocks do not overlap (stride = block size);
  o_cmp is attention over the compressed tokens;
- selection: each query attends to every key of its ``topk`` blocks with the largest
  compressed-attention probabilities, summed over the query heads of a GQA group so that the
  group shares its blocks (the paper's selection; with selection blocks equal to compression
  blocks the importance is the compressed probability itself);
- sliding window: each query attends to the keys at distance at most ``window`` from its
  position (2 window + 1 keys; in cross-attention positions are indices).

No causal mask and no forced initial or local blocks: the bidirectional form vision uses.
The gates g (the paper's sigmoid of an MLP of the input, in the layer
:class:`mita.layers.nsa.NSAAttention`) are an argument, (B, H, Nq, 3) broadcastable, 1 if
not given. With every block selected and a window covering the sequence (and, for the
compressed branch, blocks of one key) each branch is softmax attention over the whole
sequence. Compression and routing by position (spec section 5). The reference builds the
(Nq, Nk) masks. The efficient path works on chunks of consecutive queries, in memory linear in
N: the (query, selected block) pairs grouped by block into tiles, one batched matmul each (as
MoBA's path), and the keys within reach of the chunk's windows as one contiguous slice.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checks import AttentionArgs, check_int
from .common import (
    check_positive_int,
    checked_inputs,
    chunk_rows,
    grouped_heads,
    key_mask_of,
    softmax_allowed,
    zero_padded,
)
from .tiling import tile_rows


def _check(q, k, v, block_size, topk, window, gates, key_padding_mask, query_padding_mask, dropout_p, scale):
    """Checked arguments, the gates (B, H, Nq, 3) and q, k, v with padded slots zero."""
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    check_positive_int("block_size", block_size)
    check_positive_int("topk", topk)
    check_int("window", window, 0)
    shape = (q.shape[0], q.shape[1], q.shape[2], 3)
    if gates is None:
        gates = q.new_ones(1, 1, 1, 3)
    elif not isinstance(gates, torch.Tensor) or not gates.is_floating_point():
        raise TypeError(f"gates must be a float tensor broadcastable to {shape} or None, got {type(gates).__name__}")
    elif gates.device != q.device:
        raise ValueError(f"gates are on {gates.device} but q is on {q.device}")
    try:
        gates = gates.to(q.dtype).expand(shape)
    except RuntimeError:
        raise ValueError(f"gates of shape {tuple(gates.shape)} must broadcast to (B, H, Nq, 3) = {shape}") from None
    return cfg, gates, q, k, v


def key_blocks(t: torch.Tensor, real: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (or values) ``t`` (B, Hkv, Nk, D) cut into blocks, (B, Hkv, nb, block_size, D) with
    nb = ceil(Nk / block_size), the last block zero-filled past Nk, and which slots hold a real key
    (B, nb, block_size), from ``real`` (B, Nk): what a learned compression reads."""
    B, Hkv, Nk, D = t.shape
    nb = math.ceil(Nk / block_size)
    pad = nb * block_size - Nk
    return F.pad(t, (0, 0, 0, pad)).reshape(B, Hkv, nb, block_size, D), F.pad(real, (0, pad)).reshape(B, nb, block_size)


def block_means(blocks: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The mean of each block's real rows (B, Hkv, nb, D), from :func:`key_blocks`' output (padded rows zero)."""
    den = real.sum(-1).clamp(min=1).to(blocks.dtype)[:, None, :, None]
    return blocks.sum(3) / den


def _compress(k, v, real, block_size: int, compressed: tuple[torch.Tensor, torch.Tensor] | None):
    """The compressed keys and values, (B, Hkv, nb, D) each: ``compressed`` where given, else the block
    means of the real keys and values; and whether a block holds a real key (B, nb)."""
    B, Hkv, Nk, D = k.shape
    nb = math.ceil(Nk / block_size)
    valid = F.pad(real, (0, nb * block_size - Nk)).view(B, nb, block_size).any(-1)
    if compressed is None:
        return *(block_means(*key_blocks(t, real, block_size)) for t in (k, v)), valid
    shape = (B, Hkv, nb, D)
    if not (isinstance(compressed, (tuple, list)) and len(compressed) == 2):
        raise TypeError("compressed must be a pair (k_cmp, v_cmp) of tensors or None")
    for name, t in zip(("k_cmp", "v_cmp"), compressed):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != k.dtype or t.device != k.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"compressed {name} must be (B, Hkv, ceil(Nk / block_size), D) = {shape} of k's dtype and device "
                f"({k.dtype} on {k.device}), got {got}"
            )
    return *compressed, valid


def _attend(logits: torch.Tensor, allowed: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Softmax over the allowed entries; a row with none allowed is zero (a window of padded keys only)."""
    p = softmax_allowed(logits, allowed) * allowed.any(-1, keepdim=True)
    return F.dropout(p, dropout_p) if dropout_p > 0 else p


def _compressed(q, k_cmp, v_cmp, valid, cfg: AttentionArgs, dropout_p):
    """The compressed branch: its output (B, Hkv, G, Nq, D) and the block importance (B, Hkv, Nq, nb)."""
    qg = grouped_heads(q, k_cmp.shape[1])
    logits = cfg.scale * qg @ k_cmp.unsqueeze(2).transpose(-1, -2)  # (B, Hkv, G, Nq, nb)
    p = softmax_allowed(logits, valid[:, None, None, None, :])
    out = (F.dropout(p, dropout_p) if dropout_p > 0 else p) @ v_cmp.unsqueeze(2)
    return out, p.sum(2)


def _select(importance: torch.Tensor, valid: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` most important blocks of each (query, kv group) (B, Hkv, Nq, n) and whether each holds a
    real key (a block with none is never chosen before one with some)."""
    importance = importance.masked_fill(~valid[:, None, None, :], float("-inf"))
    score, blocks = importance.topk(min(topk, importance.shape[-1]), dim=-1)
    return blocks, score > float("-inf")


def _branches(q, k, v, block_size, topk, cfg, dropout_p, compressed):
    """What both paths share: the compressed branch's output and the selected blocks."""
    k_cmp, v_cmp, valid = _compress(k, v, key_mask_of(cfg, k), block_size, compressed)
    out_cmp, importance = _compressed(q, k_cmp, v_cmp, valid, cfg, dropout_p)
    return out_cmp, *_select(importance, valid, topk)


def nsa_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int = 64,
    topk: int = 4,
    window: int = 64,
    gates: torch.Tensor | None = None,
    compressed: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """NSA with the selected and window branches as dense attention under (Nq, Nk) masks."""
    cfg, gates, q, k, v = _check(
        q, k, v, block_size, topk, window, gates, key_padding_mask, query_padding_mask, dropout_p, scale
    )
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    out_cmp, blocks, ok = _branches(q, k, v, block_size, topk, cfg, dropout_p, compressed)
    real = key_mask_of(cfg, k)[:, None, None, None, :]  # (B, 1, 1, 1, Nk)
    nb = math.ceil(Nk / block_size)
    chosen = torch.zeros(B, Hkv, Nq, nb, dtype=torch.bool, device=q.device).scatter(-1, blocks, ok)
    selected = chosen[..., torch.arange(Nk, device=q.device) // block_size].unsqueeze(2) & real
    i, j = torch.arange(Nq, device=q.device)[:, None], torch.arange(Nk, device=q.device)
    near = ((i - j).abs() <= window) & real
    qg, kg, vg = grouped_heads(q, Hkv), k.unsqueeze(2), v.unsqueeze(2)
    logits = cfg.scale * qg @ kg.transpose(-1, -2)  # (B, Hkv, G, Nq, Nk)
    outs = [out_cmp, _attend(logits, selected, dropout_p) @ vg, _attend(logits, near, dropout_p) @ vg]
    out = sum(g.unsqueeze(-1) * o.reshape(B, H, Nq, D) for g, o in zip(gates.unbind(-1), outs))
    return zero_padded(out, cfg)


def nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int = 64,
    topk: int = 4,
    window: int = 64,
    gates: torch.Tensor | None = None,
    compressed: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Bidirectional native sparse attention on (B, H, N, D) tensors in memory linear in N.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        block_size (int): keys per block, of the compression and of the selection. Default: 64.
        topk (int): blocks selected per query (shared by a GQA group), clamped to the block count. Default: 4.
        window (int): the sliding window's reach: keys at distance <= window, 0 for the own position only.
            Default: 64.
        gates (torch.Tensor | None): float, broadcastable to (B, H, Nq, 3): the weights of the compressed,
            selected and window branches. Default: None (all 1).
        compressed (tuple | None): the compressed block tokens (k_cmp, v_cmp), each (B, Hkv, nb, D) with
            nb = ceil(Nk / block_size), e.g. the paper's learned compression of :func:`key_blocks`' blocks
            (the layer's ``compression="mlp"``). Default: None (each block's mean of its real keys and values).
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): dropout on the three branches' attention probabilities. Default: 0.0.
        scale (float | None): logit scale, positive and finite. Default: D**-0.5.
        chunk_size (int | None): queries per chunk; None keeps a chunk's gathered keys near 2^24 elements.
            Default: None.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, gates, q, k, v = _check(
        q, k, v, block_size, topk, window, gates, key_padding_mask, query_padding_mask, dropout_p, scale
    )
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, bs = H // Hkv, block_size
    out_cmp, blocks, ok = _branches(q, k, v, block_size, topk, cfg, dropout_p, compressed)
    blocks, ok = blocks.repeat_interleave(G, dim=1), ok.repeat_interleave(G, dim=1)  # per query head
    real = key_mask_of(cfg, k)
    nb, n_sel = math.ceil(Nk / bs), blocks.shape[-1]
    pad = nb * bs - Nk
    kb, vb = (F.pad(t, (0, 0, 0, pad)).reshape(B * Hkv * nb, bs, D) for t in (k, v))  # row (b Hkv + kv) nb + block
    real_b = F.pad(real, (0, pad)).view(B, nb, bs)
    kv_block = (torch.arange(B, device=q.device)[:, None] * Hkv + torch.arange(H, device=q.device) // G) * nb
    batch = torch.arange(B, device=q.device)[:, None, None, None]
    reach = min(window, max(Nq, Nk) - 1)
    step = chunk_rows(Nq, B * H * (n_sel * (bs + D) + 2 * reach + 1), chunk_size)
    if chunk_size is None:  # windows of consecutive queries share their keys: chunks about as long as a window
        step = min(step, max(64, 2 * reach + 1))
    outs = []
    for start in range(0, Nq, step):
        qc = q[:, :, start : start + step]
        C = qc.shape[2]
        # selected blocks: one row per (query, block), grouped by block into tiles of T rows (as MoBA's path)
        sel = blocks[:, :, start : start + C]  # (B, H, C, n)
        slot, tile_block, T = tile_rows((kv_block[:, :, None, None] + sel).reshape(-1), B * Hkv * nb)
        n_rows = tile_block.numel() * T
        q_rows = qc.unsqueeze(3).expand(B, H, C, n_sel, D).reshape(-1, D)
        q_t = q.new_zeros(n_rows, D).index_put((slot,), q_rows).view(-1, T, D)
        scores = (q_t @ kb[tile_block].transpose(1, 2)).view(n_rows, bs)[slot].view(B, H, C, n_sel * bs)
        allowed = (real_b[batch, sel] & ok[:, :, start : start + C, :, None]).flatten(-2)
        p = _attend(cfg.scale * scores, allowed, dropout_p)
        p_t = q.new_zeros(n_rows, bs).index_put((slot,), p.reshape(-1, bs)).view(-1, T, bs)
        out_slc = (p_t @ vb[tile_block]).view(n_rows, D)[slot].view(B, H, C, n_sel, D).sum(3)
        # the window: the keys within reach of the chunk, a contiguous slice
        lo, hi = max(0, start - reach), min(Nk, start + C + reach)
        rows = torch.arange(start, start + C, device=q.device)[:, None]
        cols = torch.arange(lo, max(lo, hi), device=q.device)
        near = ((rows - cols).abs() <= reach) & real[:, None, lo:hi]  # (B, C, L)
        qg = grouped_heads(qc, Hkv)
        logits = cfg.scale * qg @ k[:, :, lo:hi].unsqueeze(2).transpose(-1, -2)  # (B, Hkv, G, C, L)
        out_win = (_attend(logits, near[:, None, None], dropout_p) @ v[:, :, lo:hi].unsqueeze(2)).view(B, H, C, D)
        g = gates[:, :, start : start + C].unbind(-1)
        cmp = out_cmp[:, :, :, start : start + C].reshape(B, H, C, D)
        outs.append(g[0].unsqueeze(-1) * cmp + g[1].unsqueeze(-1) * out_slc + g[2].unsqueeze(-1) * out_win)
    return zero_padded(torch.cat(outs, dim=2), cfg)


def nsa_flops(n: int, d: int, block_size: int = 64, topk: int = 4, window: int = 64, **_: object) -> float:
    """Attention (4 N D per key) over the N/b compressed tokens, the k b selected keys and the
    2 w + 1 keys of the window."""
    nb = math.ceil(n / block_size)
    return 4 * n * d * (nb + min(topk, nb) * block_size + min(2 * window + 1, n))
