"""Multi-head linear attention over token blocks (Zhang, Huang, Deng, Yu, Chen, Ling, Xie and Zhou, "MHLA:
Restoring Expressivity of Linear Attention via Token-Level Multi-Head", ICLR 2026, arXiv 2601.07832).

Linear attention gives every query one D x D summary of the context ("global context
collapse"). MHLA splits the tokens into m blocks (its heads along the token dimension), keeps
one summary per block, S_b = sum_{j in b} phi(k_j) v_j^T, and lets the queries of block c read
a mixture of them, out_i = phi(q_i) sum_b M[c, b] S_b. As in the MiTA authors' comparison code
(QishuaiWen/MiTA, ``MiTA-DeiT/mita/mhla.py``, after DAGroup-PKU/MHLA): phi(x) = ReLU(x) + 1e-6,
no normaliser (removed there, after the MHLA authors' advice in their issue 4), and M
initialised from the distances between block centres on the block grid,
M[c, b] = cos(pi/4 d(c, b) / max d) / sum_c' cos(pi/4 d(c', b) / max d) (each block's summary is
spread with total weight 1), learned by the layer (:class:`mita.layers.mhla.MHLAAttention`);
this op takes M as an argument, that matrix if not given.

The blocks: the tokens between ``num_prefix_tokens`` and ``num_suffix_tokens`` on ``grid`` ((gh, gw): (mh, mw) blocks of
consecutive rows and columns, the authors' 4 x 4 windows on 16 x 16 patches; a 3-D grid alike)
or, with ``grid=None``, m runs of consecutive real tokens (token of rank r among n goes to
block floor(r m / n)). Queries and keys are blocked alike, each over its own real tokens.
Prefix and suffix tokens (CLS, registers) belong to no block: as keys their summary is added to every block's
mixture, as queries they read all summaries (unnormalised linear attention over everything).
With one block every query reads everything: linear attention without normaliser.
Compression into m linear experts, routed by position (spec section 5). The reference forms
the (Nq, Nk) matrix; the efficient path gathers each block's tokens, O(N D^2 + m^2 D^2).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from .common import gather_rows
from .kernelized import check_linear, finish, mask_features
from .pooling import Pooling, check_pooling

#: the authors' constant added to ReLU's output
EPS = 1e-6


def block_mixing(shape: tuple[int, ...], device=None, dtype=None) -> torch.Tensor:
    """The authors' cosine mixing of m = prod(shape) blocks laid out on ``shape``: (m, m), columns summing to 1."""
    centres = torch.tensor(list(itertools.product(*(range(s) for s in shape))), dtype=torch.float64)
    dist = torch.cdist(centres, centres)
    far = dist.max()
    mat = torch.cos(dist / far * math.pi / 4) if far > 0 else torch.ones_like(dist)
    return (mat / mat.sum(0, keepdim=True)).to(device=device, dtype=dtype or torch.get_default_dtype())


def assign_blocks(n: int, pooling: Pooling, mask: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """Each token's block (B, n), -1 for the prefix and suffix tokens, -2 for padded tokens."""
    p, s, m, span = pooling.num_prefix_tokens, pooling.num_suffix_tokens, pooling.m, pooling.span(n)
    real = torch.ones(batch, n, dtype=torch.bool, device=device) if mask is None else mask
    if pooling.grid is None:
        rank = real[:, span].cumsum(1) - 1
        count = real[:, span].sum(1, keepdim=True).clamp(min=1)
        inner = rank * m // count
    else:
        coords = torch.unravel_index(torch.arange(n - p - s, device=device), pooling.grid)
        inner = torch.zeros(n - p - s, dtype=torch.long, device=device)
        for c, g, b in zip(coords, pooling.grid, pooling.shape):
            inner = inner * b + c * b // g
        inner = inner.expand(batch, -1)
    blocks = torch.cat([inner.new_full((batch, p), -1), inner, inner.new_full((batch, s), -1)], 1)
    return blocks.masked_fill(~real, -2)


def _check(q, k, v, num_blocks, grid, ends, mixing, key_padding_mask, query_padding_mask, dropout_p):
    """Checked arguments, the features, v, each token's block (queries and keys), the mixing (m, m) and the
    block layout."""
    cfg, q, k, v = check_linear("MHLA", q, k, v, key_padding_mask, query_padding_mask, dropout_p)
    B = q.shape[0]
    prefix, suffix = ends  # the unblocked tokens at either end
    pooling = check_pooling(num_blocks, grid, prefix, q.shape[2], num_suffix_tokens=suffix, name="num_blocks")
    if k.shape[2] != q.shape[2]:  # the keys are blocked alike: the same layout must fit them
        check_pooling(num_blocks, grid, prefix, k.shape[2], num_suffix_tokens=suffix, name="num_blocks")
    m = pooling.m
    if mixing is None:
        mixing = block_mixing(pooling.shape, q.device, q.dtype)
    elif not isinstance(mixing, torch.Tensor) or not mixing.is_floating_point():
        raise TypeError(f"mixing must be a float tensor of shape (m={m}, m={m}) or None, got {type(mixing).__name__}")
    elif tuple(mixing.shape) != (m, m) or mixing.device != q.device:
        raise ValueError(f"mixing must have shape (m={m}, m={m}) and be on {q.device}, got {tuple(mixing.shape)}")
    qf, kf = mask_features(F.relu(q) + EPS, F.relu(k) + EPS, cfg)
    q_blocks = assign_blocks(q.shape[2], pooling, cfg.query_mask, B, q.device)
    k_blocks = assign_blocks(k.shape[2], pooling, cfg.key_mask, B, q.device)
    return cfg, qf, kf, v, q_blocks, k_blocks, mixing.to(q.dtype), pooling


def mhla_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_blocks: int | tuple[int, ...] = 16,
    grid: tuple[int, ...] | None = None,
    num_prefix_tokens: int = 0,
    num_suffix_tokens: int = 0,
    mixing: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The matrix form: A_ij = phi(q_i) . phi(k_j) C_ij with C_ij = M[block(i), block(j)] (1 where either is a
    prefix or suffix token, 0 for a padded key), out = A V."""
    cfg, qf, kf, v32, qb, kb, mixing, _ = _check(
        q,
        k,
        v,
        num_blocks,
        grid,
        (num_prefix_tokens, num_suffix_tokens),
        mixing,
        key_padding_mask,
        query_padding_mask,
        dropout_p,
    )
    G = q.shape[1] // k.shape[1]
    qi, kj = qb[:, :, None], kb[:, None, :]  # (B, Nq, 1), (B, 1, Nk)
    weight = mixing[qi.clamp(min=0), kj.clamp(min=0)]
    weight = torch.where((qi == -1) | (kj == -1), 1.0, weight).masked_fill(kj == -2, 0)
    scores = qf @ kf.repeat_interleave(G, dim=1).transpose(-1, -2) * weight[:, None]
    return finish(scores @ v32.repeat_interleave(G, dim=1), cfg, q.dtype)


def block_capacity(pooling: Pooling, n: int) -> int:
    """An upper bound on the tokens of one block of n tokens: ceil(L / m) in 1-D, the product of ceil(g / s)."""
    if pooling.grid is None:
        return max(1, -(-(n - pooling.num_prefix_tokens - pooling.num_suffix_tokens) // pooling.m))
    return math.prod(-(-g // s) for g, s in zip(pooling.grid, pooling.shape))


def _slots(blocks: torch.Tensor, m: int, capacity: int) -> torch.Tensor:
    """(B, m, capacity) token positions of each block; n (a zero row) fills the rest. No host synchronisation."""
    B, n = blocks.shape
    key = torch.where(blocks >= 0, blocks, m)  # prefix and padded tokens: a bucket of their own, dropped
    order = torch.argsort(key * n + torch.arange(n, device=blocks.device), dim=1)
    sorted_key = key.gather(1, order)
    count = F.one_hot(key, m + 1).sum(1)  # (B, m + 1)
    rank = torch.arange(n, device=blocks.device) - (count.cumsum(1) - count).gather(1, sorted_key)
    slot = sorted_key * capacity + rank.clamp(max=capacity - 1)  # a real block's ranks stay below its capacity
    slots = blocks.new_full((B, (m + 1) * capacity), n).scatter(1, slot, order)
    return slots.view(B, m + 1, capacity)[:, :m]


def _by_block(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x (B, h, n, F) gathered by block: (B, h, m, L, F), zero rows for the fill."""
    B, h = x.shape[:2]
    m, L = slots.shape[1:]
    padded = F.pad(x, (0, 0, 0, 1))
    return gather_rows(padded, slots.reshape(B, 1, -1).expand(B, h, -1)).view(B, h, m, L, -1)


def mhla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_blocks: int | tuple[int, ...] = 16,
    grid: tuple[int, ...] | None = None,
    num_prefix_tokens: int = 0,
    num_suffix_tokens: int = 0,
    mixing: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """MHLA on (B, H, N, D) tensors in O(N D^2 + m^2 D^2).

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        num_blocks (int | tuple): m; with a grid, (mh, mw) / a perfect square, or (mt, mh, mw) / a perfect cube.
            Default: 16 (the authors' comparison: 4 x 4 blocks).
        grid (tuple | None): (gh, gw) or (gt, gh, gw) layout of the tokens after the prefix (both q's and k's);
            None blocks runs of the sequence. Default: None.
        num_prefix_tokens (int): leading tokens (CLS) in no block. Default: 0.
        num_suffix_tokens (int): trailing tokens (registers) in no block. Default: 0.
        mixing (torch.Tensor | None): M (m, m), the weight of block b's summary for the queries of block c
            at [c, b]. Default: None, the authors' cosine initialisation (:func:`block_mixing`).
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, qf, kf, v32, qb, kb, mixing, pooling = _check(
        q,
        k,
        v,
        num_blocks,
        grid,
        (num_prefix_tokens, num_suffix_tokens),
        mixing,
        key_padding_mask,
        query_padding_mask,
        dropout_p,
    )
    B, H, Nq, _ = q.shape
    Hkv, Dv, m = k.shape[1], v.shape[3], mixing.shape[0]
    k_slots = _slots(kb, m, block_capacity(pooling, k.shape[2]))
    q_slots = _slots(qb, m, block_capacity(pooling, Nq))
    states = _by_block(kf, k_slots).transpose(-1, -2) @ _by_block(v32, k_slots)  # (B, Hkv, m, D, Dv)
    p, s, Nk = pooling.num_prefix_tokens, pooling.num_suffix_tokens, k.shape[2]
    ends = [slice(0, p), slice(Nk - s, Nk)]  # the unblocked keys (prefix and suffix)
    shared = sum(kf[:, :, e].transpose(-1, -2) @ v32[:, :, e] for e in ends)  # (B, Hkv, D, Dv): their summary
    mixed = torch.einsum("cb,zkbfd->zkcfd", mixing, states) + shared.unsqueeze(2)
    reads = _by_block(qf, q_slots).unflatten(1, (Hkv, H // Hkv)) @ mixed.unsqueeze(2)  # (B, Hkv, G, m, L, Dv)
    index = q_slots.reshape(B, 1, -1, 1).expand(B, H, -1, Dv)  # the fill slots all write row Nq, dropped
    out = qf.new_zeros(B, H, Nq + 1, Dv).scatter(2, index, reads.reshape(B, H, -1, Dv))[:, :, :Nq]
    everything = (states.sum(2) + shared).repeat_interleave(H // Hkv, dim=1)  # what unblocked queries read
    out = torch.cat([qf[:, :, :p] @ everything, out[:, :, p : Nq - s], qf[:, :, Nq - s :] @ everything], 2)
    return finish(out, cfg, q.dtype)


def mhla_flops(n: int, d: int, num_blocks: int | tuple[int, ...] = 16, **_: object) -> float:
    """The block summaries and the queries' reads (2 N D^2 each) and the mixing (2 m^2 D^2)."""
    m = math.prod(num_blocks) if isinstance(num_blocks, (tuple, list)) else num_blocks
    return 4 * n * d * d + 2 * m * m * d * d
