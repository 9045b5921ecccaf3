"""Triton kernels of MiTA's joint softmax (spec section 2, step 6), forward and backward.

One program per tile of ``BLOCK_M`` rows, each row a (query, routed expert) pair; the rows
of a tile all belong to one expert of one head (:func:`mita.ops.tiling.tile_rows`), so the
tile's keys are that expert's k keys, gathered by index, and its landmarks are the head's m
landmarks. A row whose route rank is 0 also takes the m landmark logits (the shared expert,
values = the shared values), so that each query counts the shared expert once; rows with
rank > 0 hold only their routed keys, and the glue merges a query's s partial results by
their log-sum-exps. Padding rows hold pair -1; a tile without a real row (the grid is an
upper bound) exits at once. Products accumulate in float32.

The backward recomputes the probabilities from the merged log-sum-exp (FlashAttention-2):
p = exp(logit - lse), ds = p (dp - delta) with delta = rowsum(dO * O); dq per row, and
atomic float32 adds for the keys', values', landmarks' and shared values' gradients.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in float32; float32 inputs exactly (no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _tile(t, tile_expert, row_pair, M: tl.constexpr, S: tl.constexpr, H, G, Hkv, BLOCK_M: tl.constexpr):
    """Where tile t reads from: its expert, head, rows, their validity, query rows, rank-0 flags, kv head.

    A row's pair is (query row in q flattened) * S + route rank, or -1 for a padding row.
    """
    e = tl.load(tile_expert + t)
    x = e // M  # the query head (b * H + h)
    rows = t.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: offsets past 2**31 at large B H N D
    pair = tl.load(row_pair + rows)
    valid = pair >= 0
    qrow = tl.where(valid, pair // S, 0)
    first = valid & (pair % S == 0)
    kvh = (x // H) * Hkv + (x % H) // G
    return e, x, rows, valid, qrow, first, kvh


@triton.jit
def _destination(rows, qrow, S: tl.constexpr):
    """Where a tile's rows are written: with one route (S = 1) straight to their query rows (the
    output itself, in its dtype), else to their slots in the buffer of partial results."""
    if S == 1:
        return qrow
    return rows


@triton.jit
def mita_fwd_kernel(
    q,
    k,
    v,
    lm,
    vs,
    experts,
    key_mask,
    tile_expert,
    row_pair,
    o_part,
    lse_part,
    Nk,
    H,
    G,
    Hkv,
    scale,
    lm_scale,
    M: tl.constexpr,
    S: tl.constexpr,
    KK: tl.constexpr,
    D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    e, x, rows, valid, qrow, first, kvh = _tile(t, tile_expert, row_pair, M, S, H, G, Hkv, BLOCK_M)
    if tl.sum(valid.to(tl.int32), 0) == 0:  # a spare tile of the upper-bound grid
        return
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qt = tl.load(q + qrow[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(0, M, BLOCK_N):  # the shared expert: landmark logits, shared values
        cols = c + tl.arange(0, BLOCK_N)
        cm = cols < M
        kmask = cm[:, None] & dmask[None, :]
        kt = tl.load(lm + (x * M + cols)[:, None] * D + d[None, :], mask=kmask, other=0.0)
        vt = tl.load(vs + (x * M + cols)[:, None] * D + d[None, :], mask=kmask, other=0.0)
        s = _dot(qt, tl.trans(kt), IEEE) * lm_scale
        s = tl.where(first[:, None] & cm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
        m_i = m_new
    for c in range(0, KK, BLOCK_N):  # the routed expert's keys, gathered by index
        cols = c + tl.arange(0, BLOCK_N)
        cm = cols < KK
        idx = tl.load(experts + e * KK + cols, mask=cm, other=0)
        if HAS_MASK:
            cm = cm & (tl.load(key_mask + (x // H) * Nk + idx, mask=cm, other=0) != 0)
        kmask = cm[:, None] & dmask[None, :]
        kt = tl.load(k + (kvh * Nk + idx)[:, None] * D + d[None, :], mask=kmask, other=0.0)
        vt = tl.load(v + (kvh * Nk + idx)[:, None] * D + d[None, :], mask=kmask, other=0.0)
        s = _dot(qt, tl.trans(kt), IEEE) * scale
        s = tl.where(cm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    dst = _destination(rows, qrow, S)
    out = (acc / l_safe[:, None]).to(o_part.dtype.element_ty)
    tl.store(o_part + dst[:, None] * D + d[None, :], out, mask=valid[:, None] & dmask[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    tl.store(lse_part + dst, lse, mask=valid)


@triton.jit
def mita_bwd_kernel(
    q,
    k,
    v,
    lm,
    vs,
    experts,
    key_mask,
    tile_expert,
    row_pair,
    dout,
    lse,
    delta,
    dq_part,
    dk,
    dv,
    dlm,
    dvs,
    Nk,
    H,
    G,
    Hkv,
    scale,
    lm_scale,
    M: tl.constexpr,
    S: tl.constexpr,
    KK: tl.constexpr,
    D: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    e, x, rows, valid, qrow, first, kvh = _tile(t, tile_expert, row_pair, M, S, H, G, Hkv, BLOCK_M)
    if tl.sum(valid.to(tl.int32), 0) == 0:
        return
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = valid[:, None] & dmask[None, :]
    qt = tl.load(q + qrow[:, None] * D + d[None, :], mask=qmask, other=0.0)
    do = tl.load(dout + qrow[:, None] * D + d[None, :], mask=qmask, other=0.0)
    L = tl.load(lse + qrow, mask=valid, other=0.0)
    dl = tl.load(delta + qrow, mask=valid, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(0, M, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        cm = cols < M
        kmask = cm[:, None] & dmask[None, :]
        kt = tl.load(lm + (x * M + cols)[:, None] * D + d[None, :], mask=kmask, other=0.0)
        vt = tl.load(vs + (x * M + cols)[:, None] * D + d[None, :], mask=kmask, other=0.0)
        s = _dot(qt, tl.trans(kt), IEEE) * lm_scale
        live = first[:, None] & cm[None, :]
        p = tl.where(live, tl.exp(s - L[:, None]), 0.0)
        dp = _dot(do, tl.trans(vt), IEEE)
        ds = p * (dp - dl[:, None])
        dq += _dot(ds.to(kt.dtype), kt, IEEE) * lm_scale
        ptrs = (x * M + cols)[:, None] * D + d[None, :]
        tl.atomic_add(dlm + ptrs, _dot(tl.trans(ds.to(qt.dtype)), qt, IEEE) * lm_scale, mask=kmask)
        tl.atomic_add(dvs + ptrs, _dot(tl.trans(p.to(do.dtype)), do, IEEE), mask=kmask)
    for c in range(0, KK, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        cm = cols < KK
        idx = tl.load(experts + e * KK + cols, mask=cm, other=0)
        if HAS_MASK:
            cm = cm & (tl.load(key_mask + (x // H) * Nk + idx, mask=cm, other=0) != 0)
        kmask = cm[:, None] & dmask[None, :]
        ptrs = (kvh * Nk + idx)[:, None] * D + d[None, :]
        kt = tl.load(k + ptrs, mask=kmask, other=0.0)
        vt = tl.load(v + ptrs, mask=kmask, other=0.0)
        s = _dot(qt, tl.trans(kt), IEEE) * scale
        live = valid[:, None] & cm[None, :]
        p = tl.where(live, tl.exp(s - L[:, None]), 0.0)
        dp = _dot(do, tl.trans(vt), IEEE)
        ds = p * (dp - dl[:, None])
        dq += _dot(ds.to(kt.dtype), kt, IEEE) * scale
        tl.atomic_add(dk + ptrs, _dot(tl.trans(ds.to(qt.dtype)), qt, IEEE) * scale, mask=kmask)
        tl.atomic_add(dv + ptrs, _dot(tl.trans(p.to(do.dtype)), do, IEEE), mask=kmask)
    dst = _destination(rows, qrow, S)
    tl.store(dq_part + dst[:, None] * D + d[None, :], dq.to(dq_part.dtype.element_ty), mask=qmask)
