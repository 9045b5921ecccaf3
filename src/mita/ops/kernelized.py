"""What the kernelized linear attentions share (FLatten, PolaFormer, InLine, MHLA, TTT-Linear).

Their argument checks (no attention matrix, so no dropout), per-head parameter tensors such
as a learned feature scale or exponent, the accumulation dtype, and normalised linear
attention phi(q) . sum_j phi(k_j) v_j^T / (phi(q) . sum_j phi(k_j) + eps) in its efficient
form (a D x D state per kv head) and its matrix form (the tests' oracle).
"""

from __future__ import annotations

import math
import numbers

import torch

from .checks import AttentionArgs, require
from .common import checked_inputs
from .tiling import zero_padded


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision (features raised to powers overflow float16), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_linear(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    query_padding_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None = None,
) -> tuple[AttentionArgs, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked arguments, and q, k, v with their padded slots zero and in the accumulation dtype.

    ``dropout_p`` must be 0: there are no attention probabilities to drop.
    """
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    if dropout_p:
        raise ValueError(f"{name} has no attention matrix to drop out; use dropout_p=0, got {dropout_p!r}")
    acc = accumulation_dtype(q.dtype)
    return cfg, q.to(acc), k.to(acc), v.to(acc)


def check_positive(name: str, value: object) -> float:
    """``value`` as a positive finite float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive float, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return float(value)


def head_tensor(
    name: str, value: object, k: torch.Tensor, low: float = 0.0, closed: bool = False
) -> torch.Tensor | float:
    """A per-(kv head, channel) parameter: a float, or a tensor broadcastable to (Hkv, D), as (1, Hkv, 1, D).

    Its values must exceed ``low`` (or equal it, with ``closed``); a tensor keeps its graph, so a
    layer can learn it. Query head h uses the parameter of kv head h // (H / Hkv).
    """
    bound = f">= {low}" if closed else f"> {low}"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and (value >= low if closed else value > low)):
            raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
        return float(value)
    Hkv, D = k.shape[1], k.shape[3]
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{name} must be a float or a float tensor broadcastable to (Hkv={Hkv}, D={D}), got {value!r}")
    try:
        fits = torch.broadcast_shapes(value.shape, (Hkv, D)) == (Hkv, D)
    except RuntimeError:
        fits = False
    if not fits or value.device != k.device:
        raise ValueError(
            f"{name} must broadcast to (Hkv={Hkv}, D={D}) on {k.device}, got {tuple(value.shape)} on {value.device}"
        )
    ok = torch.isfinite(value) & ((value >= low) if closed else (value > low))
    require(ok, lambda: ValueError(f"{name} must be finite and {bound} everywhere"))
    return value.to(accumulation_dtype(k.dtype)).expand(Hkv, D)[None, :, None, :]


def for_queries(param: torch.Tensor | float, H: int) -> torch.Tensor | float:
    """A (1, Hkv, 1, D) kv-head parameter repeated for the H query heads (a float stays a float)."""
    if isinstance(param, float):
        return param
    return param.repeat_interleave(H // param.shape[1], dim=1)


def mask_features(qf: torch.Tensor, kf: torch.Tensor, cfg: AttentionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the features of padded queries and keys (a feature map may be nonzero at 0)."""
    if cfg.key_mask is not None:
        kf = kf.masked_fill(~cfg.key_mask[:, None, :, None], 0)
    if cfg.query_mask is not None:
        qf = qf.masked_fill(~cfg.query_mask[:, None, :, None], 0)
    return qf, kf


def real_key_count(cfg: AttentionArgs, k: torch.Tensor) -> torch.Tensor:
    """The number of real keys of each batch element as (B, 1, 1, 1) in k's dtype."""
    if cfg.key_mask is None:
        return torch.full((k.shape[0], 1, 1, 1), k.shape[2], dtype=k.dtype, device=k.device)
    return cfg.key_mask.sum(1).to(k.dtype)[:, None, None, None]


def normalised_linear(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, eps: float, count: torch.Tensor | None = None
) -> torch.Tensor:
    """phi(q) (phi(K)^T V / c) / (phi(q) . sum phi(K) / c + eps) with one state per kv head, O(N F Dv).

    qf (B, H, Nq, F), kf (B, Hkv, Nk, F), v (B, Hkv, Nk, Dv); c is ``count`` (B, 1, 1, 1), or 1.
    """
    B, H, Nq, Fq = qf.shape
    Hkv = kf.shape[1]
    if count is not None:
        kf = kf / count
    qg = qf.view(B, Hkv, H // Hkv, Nq, Fq)
    num = qg @ (kf.transpose(-1, -2) @ v).unsqueeze(2)
    den = qg @ kf.sum(2)[:, :, None, :, None]
    return (num / (den + eps)).view(B, H, Nq, v.shape[3])


def normalised_linear_reference(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, eps: float, count: torch.Tensor | None = None
) -> torch.Tensor:
    """The same as the (Nq, Nk) matrix S = phi(Q) phi(K)^T / c: out = S V / (S 1 + eps)."""
    G = qf.shape[1] // kf.shape[1]
    S = qf @ kf.repeat_interleave(G, dim=1).transpose(-1, -2)
    if count is not None:
        S = S / count
    return S @ v.repeat_interleave(G, dim=1) / (S.sum(-1, keepdim=True) + eps)


def finish(out: torch.Tensor, cfg: AttentionArgs, dtype: torch.dtype) -> torch.Tensor:
    """The output in the inputs' dtype with the rows of padded queries zero."""
    return zero_padded(out.to(dtype), cfg)
