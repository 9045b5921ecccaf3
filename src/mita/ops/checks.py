"""The argument checks every op shares: q, k, v, the padding masks, dropout, scales and integer options.

Every bad input raises a ``ValueError`` or ``TypeError`` that names the argument and
says what would be valid, before any arithmetic runs. Method-specific checks (MiTA's
m, k, s, the pooling grid) build on :func:`check_attention`.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AttentionArgs:
    """The checked arguments every op shares."""

    scale: float  # s0, default D**-0.5
    key_mask: torch.Tensor | None  # (B, Nk) bool, True = real key
    query_mask: torch.Tensor | None  # (B, Nq) bool, True = real query


def host_readable(t: torch.Tensor) -> bool:
    """Whether reading t's values back to Python is free: a real CPU tensor, eager (not traced).

    Elsewhere (CUDA, fake tensors, ``torch.compile``) the ops read no value back to the host:
    sizes come from upper bounds and value checks become asynchronous device asserts.
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


def require(ok: torch.Tensor, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` unless ``ok`` is all True; where values are not host-readable, an
    asynchronous device assert with the same message (no host synchronisation)."""
    if host_readable(ok):
        if not bool(ok.all()):
            raise error()
    else:
        torch._assert_async(ok.all(), str(error()))


#: the largest int an option may take: sizes and indices fit 32 bits in every kernel
INT_MAX = 2**31 - 1


def check_int(name: str, value: object, low: int = 1, high: int | None = None) -> int:
    """``value`` as a Python int in [low, high] (high at most :data:`INT_MAX`); numpy ints and 0-d integer
    tensors count, bools and tensors of other shapes do not."""
    high = INT_MAX if high is None else min(high, INT_MAX)
    ok_type = not isinstance(value, bool) and not (
        isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim() != 0)
    )
    if ok_type:
        try:
            n = operator.index(value)
        except TypeError:
            n = None
        if n is not None and low <= n <= high:
            return n
        if n is not None and n > high == INT_MAX:
            raise ValueError(f"{name} must be an int in [{low}, 2**31 - 1], got {value!r}")
    bounds = f">= {low}" if high == INT_MAX else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an int {bounds}, got {value!r}")


def check_scale(name: str, value: object, dtype: torch.dtype | None = None) -> float | None:
    """None, or ``value`` as a positive finite float; with ``dtype`` (q's), also a normal number in the
    precision the ops compute in (float32 for half precision), so that no path rounds it to 0 or inf."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive float or None, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite (or None for the default), got {value!r}")
    if dtype is not None:
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        info = torch.finfo(compute)
        if not info.tiny <= value <= info.max:
            raise ValueError(
                f"{name}={value!r} is outside {compute}'s normal range [{info.tiny:.3g}, {info.max:.3g}], where it "
                "would round to 0 or inf; scale q or k instead"
            )
    return float(value)


def check_dropout(dropout_p: object) -> float:
    """``dropout_p`` as a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _check_mask(name: str, mask: object, B: int, N: int, n_name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a bool tensor (True = real token), got {got}")
    if tuple(mask.shape) != (B, N):
        raise ValueError(f"{name} must have shape (B={B}, {n_name}={N}), got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but q is on {device}")
    return mask


def check_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> AttentionArgs:
    """Check q (B, H, Nq, D), k and v (B, Hkv, Nk, D), the masks, dropout and scale.

    Padding is said per side (spec section 2): ``key_padding_mask`` (B, Nk) marks the real
    keys, ``query_padding_mask`` (B, Nq) the real queries. Without a query mask, a call with
    Nq == Nk and a key mask is self-attention and the key mask marks the queries too; a
    query mask given (even all True) says the call is cross-attention and is used as is.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, N, D), got {tuple(t.shape)} (rank {t.dim()})")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; use float64, float32, bfloat16 or float16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type == "meta":
        raise ValueError("q, k and v are meta tensors, which hold no values to route by; use real tensors")
    B, H, Nq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, Nk, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv, Nk, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    Hkv, Nk = k.shape[1], k.shape[2]
    if B < 1 or H < 1 or D < 1 or Hkv < 1:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have B, H, D >= 1")
    if H % Hkv != 0:
        raise ValueError(f"the number of query heads H={H} must be a multiple of the kv heads Hkv={Hkv}")
    if Nq < 1 or Nk < 1:
        raise ValueError(f"empty sequence: q has Nq={Nq} and k has Nk={Nk} tokens; both need at least one")
    check_dropout(dropout_p)
    s0 = check_scale("scale", scale, q.dtype)

    key_mask = query_mask = None
    if key_padding_mask is not None:
        key_mask = _check_mask("key_padding_mask", key_padding_mask, B, Nk, "Nk", q.device)
        real = key_mask.any(1)

        def no_keys() -> ValueError:
            bad = torch.nonzero(~real).flatten().tolist() if host_readable(real) else "some"
            return ValueError(f"key_padding_mask marks no real token in batch element(s) {bad}; drop those sequences")

        require(real, no_keys)
    if query_padding_mask is not None:
        query_mask = _check_mask("query_padding_mask", query_padding_mask, B, Nq, "Nq", q.device)
    elif key_mask is not None and Nq == Nk:  # self-attention: the key mask marks the real queries too
        query_mask = key_mask
    return AttentionArgs(scale=D**-0.5 if s0 is None else s0, key_mask=key_mask, query_mask=query_mask)
