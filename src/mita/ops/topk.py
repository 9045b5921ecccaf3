"""Query-specific top-k attention: each query keeps its own k largest logits.

Every query is its own expert's router: the taxonomy's "N times one-to-one" routing.
The selection needs all N logits of a query, so the cost stays quadratic in FLOPs,
but :func:`topk_attention` works through the queries in chunks, so memory is
O(chunk x N) instead of O(N^2). This module also holds the helpers that the zoo's
ops share: argument checks, the dense masked-softmax reference and padded-row zeroing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import Method, Taxonomy, register
from .mita.config import MiTAConfig, check

# Elements (of logits or gathered keys) one query chunk may hold when chunk_size is None.
CHUNK_ELEMENTS = 1 << 24


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    num_landmarks: int | tuple[int, int] = 1,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    landmarks: torch.Tensor | None = None,
) -> MiTAConfig:
    """Validate q, k, v (B, H, N, D), the mask, dropout and pooling arguments with MiTA's checks.

    The returned config carries the resolved ``scale``, ``key_mask``, ``query_mask``
    (self-attention only), ``m``, ``pool_shape`` and ``grid``; its top-k fields are unused.
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return check(
        q, k, v, num_landmarks=num_landmarks, topk=1, num_routed=1, grid=grid, num_prefix_tokens=num_prefix_tokens,
        key_padding_mask=key_padding_mask, scale=scale, landmark_scale=None, landmarks=landmarks,
    )  # fmt: skip


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1, or a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


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


def zero_padded(out: torch.Tensor, cfg: MiTAConfig) -> torch.Tensor:
    """Output rows of padded queries (self-attention with a key padding mask) are zero."""
    return out if cfg.query_mask is None else out.masked_fill(~cfg.query_mask[:, None, :, None], 0)


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


def real_keys(cfg: MiTAConfig) -> torch.Tensor | None:
    """The key padding mask as (B, 1, 1, Nk) for :func:`softmax_allowed`, None without one."""
    return None if cfg.key_mask is None else cfg.key_mask[:, None, None, :]


def key_mask_of(cfg: MiTAConfig, k: torch.Tensor) -> torch.Tensor:
    """The (B, Nk) bool mask of real keys (all True without a key padding mask)."""
    if cfg.key_mask is not None:
        return cfg.key_mask
    return torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)


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


def _allowed_keys(cfg: MiTAConfig, k: torch.Tensor, rows: torch.Tensor, causal: bool) -> torch.Tensor:
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
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    is_causal: bool = False,
) -> torch.Tensor:
    """Top-k attention with the full (Nq, Nk) logit matrix: keep each row's k largest, softmax, sum."""
    cfg = check_inputs(q, k, v, key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale)
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
    dropout_p: float = 0.0,
    scale: float | None = None,
    causal: bool = False,
    is_causal: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Query-specific top-k attention in O(chunk x Nk) memory.

    Args:
        q: (B, H, Nq, D). k, v: (B, Hkv, Nk, D), H a multiple of Hkv.
        topk: keys each query keeps (clamped to Nk); with topk >= Nk this is softmax attention.
        key_padding_mask: bool (B, Nk), True = real key; padded keys are never kept.
        causal / is_causal: a query keeps only keys at or before its position (Nq == Nk).
        chunk_size: queries per chunk; None picks one that bounds the chunk's memory.
    """
    cfg = check_inputs(q, k, v, key_padding_mask=key_padding_mask, dropout_p=dropout_p, scale=scale)
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
        p = softmax_allowed(cfg.scale * top, top > float("-inf") if masked else None)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        vals = gather_rows(v, idx.reshape(B, Hkv, G * C * kk)).view(B, H, C, kk, D)
        outs.append((p.unsqueeze(-2) @ vals).squeeze(-2))
    return zero_padded(torch.cat(outs, dim=2), cfg)


def topk_flops(n: int, d: int, topk: int = 64, **_: object) -> float:
    """All N logits per query (2 N^2 D) plus the weighted sum of k values (2 N k D)."""
    return 2 * n * n * d + 2 * n * min(topk, n) * d


register(
    Method(
        name="topk",
        taxonomy=Taxonomy("routing", "N", "MLP (softmax)", "content-dependent (top-k)", "N times one-to-one"),
        op=topk_attention,
        defaults={"topk": 64},
        flops=topk_flops,
        cost="2 N^2 D + 2 N k D",
        paper="top-k attention (Gupta et al. 2021; Wang et al. 2022)",
    )
)
