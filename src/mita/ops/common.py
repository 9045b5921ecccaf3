"""Helpers the zoo's ops share: the checked and zero-padded inputs, the causal check, query heads grouped
by kv head, the dense masked-softmax reference, row gathers, padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import AttentionArgs, check_attention, check_int
from .tiling import zero_padded, zero_padding

__all__ = [
    "CHUNK_ELEMENTS",
    "check_causal",
    "check_positive_int",
    "checked_inputs",
    "chunk_rows",
    "gather_rows",
    "grouped_heads",
    "key_mask_of",
    "masked_attention",
    "real_keys",
    "softmax_allowed",
    "topk_indices",
    "zero_padded",
    "zero_padding",
]

# Elements (of logits or gathered keys) one query chunk may hold when chunk_size is None.
CHUNK_ELEMENTS = 1 << 24


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1, or a ValueError naming the option."""
    return check_int(name, value)


def checked_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_padding_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None = None,
) -> tuple[AttentionArgs, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every op's first step: the arguments checked (:func:`~mita.ops.checks.check_attention`), then q, k, v
    with their padded slots zero (:func:`~mita.ops.tiling.zero_padding`), before any arithmetic.

    Returns:
        (the checked arguments, q, k, v): q (B, H, Nq, D), k and v (B, Hkv, Nk, D) as given but for the zeros.
    """
    masks = {"key_padding_mask": key_padding_mask, "query_padding_mask": query_padding_mask}
    cfg = check_attention(q, k, v, **masks, dropout_p=dropout_p, scale=scale)
    return cfg, *zero_padding(q, k, v, cfg)


def grouped_heads(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Query-head tensor x (B, H, N, F) as (B, Hkv, G, N, F), G = H / Hkv: the query heads that share one kv
    head side by side (a view), so that one matmul with a kv-head tensor (B, Hkv, 1, ...) serves the group."""
    B, H, N, F = x.shape
    return x.view(B, num_kv_heads, H // num_kv_heads, N, F)


def check_causal(causal: bool, is_causal: bool, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Merge the ``causal`` option with the layer's ``is_causal``; causal needs self-attention shapes."""
    causal = bool(causal or is_causal)
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs Nq == Nk (self-attention), got Nq={q.shape[2]}, Nk={k.shape[2]}")
    return causal


def chunk_rows(n_rows: int, per_row: int, chunk_size: int | None) -> int:
    """Query rows per chunk: ``chunk_size`` if given, else as many as fit ``CHUNK_ELEMENTS``."""
    if chunk_size is not None:
        return check_positive_int("chunk_size", chunk_size)
    return max(1, min(n_rows, CHUNK_ELEMENTS // max(per_row, 1)))


def softmax_allowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the allowed entries of the last dim (all of them for None); ``allowed`` broadcasts.

    A row with nothing allowed (only padded queries have one) is left unmasked instead of
    becoming NaN, so gradients stay finite; its output row is zeroed by the caller.
    Half-precision logits are normalised in float32.
    """
    if allowed is not None:
        allowed = allowed | ~allowed.any(-1, keepdim=True)
        logits = logits.masked_fill(~allowed, float("-inf"))
    acc = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
    return torch.softmax(logits, dim=-1, dtype=acc).to(logits.dtype)


def real_keys(cfg: AttentionArgs) -> torch.Tensor | None:
    """The key padding mask as (B, 1, 1, Nk) for :func:`softmax_allowed`, None without one."""
    return None if cfg.key_mask is None else cfg.key_mask[:, None, None, :]


def key_mask_of(cfg: AttentionArgs, k: torch.Tensor) -> torch.Tensor:
    """The (B, Nk) bool mask of real keys (all True without a key padding mask)."""
    if cfg.key_mask is not None:
        return cfg.key_mask
    return torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, largest first, equal values by lower index.

    ``torch.topk`` leaves the choice among equal values unspecified (it differs by device and
    size); this is the rule of the fused CPU and Triton kernels, so that every path picks the same
    keys when keys repeat (padding, identical tokens). Half and single precision: one top-k of
    distinct 64-bit keys, the value's order bits (as the fused kernel's ``order_key``: -0 as +0,
    NaN by its sign bit) above the reversed index. float64: two top-k passes and a sort of k.
    """
    if x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        bits = (x.float() + 0.0).view(torch.int32)  # + 0.0: -0 becomes +0, so that equal values tie
        bits ^= (bits >> 31) & 0x7FFFFFFF  # negatives' magnitude bits flipped: int order is the floats' order
        keys = bits.long()
        # larger for lower indices; N - 1 .. 0, not 2**32 - 1 - index: inductor computes index arithmetic in int32
        lower_first = torch.arange(x.shape[-1] - 1, -1, -1, device=x.device)
        return keys.mul_(2**32).add_(lower_first).topk(k, dim=-1).indices  # in place: 12 bytes a value at most
    kth = x.topk(k, dim=-1).values[..., -1:]
    above, tied = x > kth, x == kth
    take = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    lower_first = torch.arange(x.shape[-1], 0, -1, device=x.device)  # distinct, larger for lower indices
    idx = (take * lower_first).topk(k, dim=-1).indices  # the taken entries, by ascending index
    order = x.gather(-1, idx).argsort(dim=-1, descending=True, stable=True)
    return idx.gather(-1, order)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``x[b, h, index[b, h, i]]`` of x (B, Hkv, R, F) for index (B, Hkv, M): (B, Hkv, M, F).

    One ``index_select`` of whole rows, which copies contiguous memory (much faster than
    ``torch.gather`` with an index expanded over F).
    """
    B, Hkv, R, _ = x.shape
    base = torch.arange(B * Hkv, device=x.device).view(B, Hkv, 1) * R
    return x.reshape(B * Hkv * R, -1).index_select(0, (index + base).reshape(-1)).view(*index.shape, -1)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, dropout_p: float = 0.0
) -> torch.Tensor:
    """Dense softmax attention over the allowed (query, key) pairs: the reference of every sparse op.

    ``allowed`` broadcasts to (B, H, Nq, Nk); k and v may have fewer (GQA) heads.
    """
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    p = softmax_allowed(scale * q @ k.transpose(-1, -2), allowed)
    return F.dropout(p, dropout_p) @ v if dropout_p > 0 else p @ v
