"""Average pooling of tokens into landmarks (MiTA), agents (Agent attention) and segment means (Nyström).

The pooled tokens are those between the first ``num_prefix_tokens`` and the last
``num_suffix_tokens`` (CLS and register tokens, at either end, attend but are not pooled): a sequence (1-D), a
row-major (gh, gw) grid (2-D) or a (gt, gh, gw) grid (3-D, video), pooled with the bin edges
of ``adaptive_avg_pool1d/2d/3d`` (spec section 2, step 1). With a padding mask each bin
averages its real tokens; in 1-D the bins are laid over each sequence's real tokens only.
Padded tokens are masked out, not weighted by zero, so whatever they hold (NaN, inf) takes no part.
:func:`pool_reference` is the spec's words, one sequence at a time; :func:`pool` the batched
path every op uses.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checks import check_int, require

_ADAPTIVE_POOL = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
_GRID_NAMES = {2: ("square", "(mh, mw)", "(gh, gw)"), 3: ("cube", "(mt, mh, mw)", "(gt, gh, gw)")}


@dataclass(frozen=True)
class Pooling:
    """Where the pooled tokens are and into how many bins they are pooled."""

    shape: tuple[int, ...]  # bins: (m,) in 1-D, (mh, mw) in 2-D, (mt, mh, mw) in 3-D
    grid: tuple[int, ...] | None  # None (1-D), (gh, gw) or (gt, gh, gw)
    num_prefix_tokens: int = 0
    num_suffix_tokens: int = 0

    @property
    def m(self) -> int:
        return math.prod(self.shape)

    def span(self, n: int) -> slice:
        """The positions of the pooled tokens in a sequence of n tokens."""
        return slice(self.num_prefix_tokens, n - self.num_suffix_tokens)


def _check_grid(grid: object) -> tuple[int, ...]:
    ok = isinstance(grid, (tuple, list)) and len(grid) in (2, 3)
    if ok:
        try:
            return tuple(check_int("grid", g) for g in grid)
        except ValueError:
            pass
    raise ValueError(f"grid must be None, a pair (gh, gw) or a triple (gt, gh, gw) of ints >= 1, got {grid!r}")


def _bins(num: object, dims: int, name: str) -> tuple[int, ...]:
    """num_landmarks for a grid of ``dims`` dimensions: a tuple of as many ints, or a perfect power."""
    power, pair, _ = _GRID_NAMES[dims]
    if isinstance(num, (tuple, list)):
        if len(num) == dims:
            try:
                return tuple(check_int(name, x) for x in num)
            except ValueError:
                pass
    else:
        n = check_int(name, num)
        side = round(n ** (1 / dims))
        if side**dims == n:
            return (side,) * dims
        raise ValueError(
            f"{name}={n} with a {dims}-D grid must be a perfect {power} (e.g. {2**dims}, {3**dims}) or {pair}"
        )
    raise ValueError(f"{name} with a {dims}-D grid must be a perfect {power} int or {pair}, got {num!r}")


def check_pooling(
    num_landmarks: object,
    grid: object,
    num_prefix_tokens: object,
    n: int,
    *,
    num_suffix_tokens: object = 0,
    name: str = "num_landmarks",
) -> Pooling:
    """Check the pooling arguments for a sequence of n tokens; ``name`` is the op's word for m."""
    prefix = check_int("num_prefix_tokens", num_prefix_tokens, 0, n - 1)
    suffix = check_int("num_suffix_tokens", num_suffix_tokens, 0, n - 1 - prefix)
    if grid is None:
        return Pooling((check_int(name, num_landmarks),), None, prefix, suffix)
    grid = _check_grid(grid)
    if math.prod(grid) != n - prefix - suffix:
        raise ValueError(
            f"grid={grid} holds {math.prod(grid)} tokens but the sequence has N - num_prefix_tokens - "
            f"num_suffix_tokens = {n - prefix - suffix}; pass the patch grid of the pooled tokens"
        )
    return Pooling(_bins(num_landmarks, len(grid), name), grid, prefix, suffix)


def _empty_bin(b: object = None) -> ValueError:
    where = "" if b is None else f" of batch element {b}"
    return ValueError(f"the padding mask leaves a pooling bin{where} with no real token; pool fewer bins")


def pool_reference(x: torch.Tensor, pooling: Pooling, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pool x (B, H, N, D) to (B, H, m, D), one sequence at a time; ``mask`` (B, N) marks the real tokens."""
    out = []
    span, grid = pooling.span(x.shape[2]), pooling.grid
    for b in range(x.shape[0]):
        xb = x[b, :, span]  # (H, L, D)
        real = None if mask is None else mask[b, span]
        if grid is None:
            if real is not None:
                xb = xb[:, real]  # the real tokens only, in order
            if xb.shape[1] == 0:
                raise _empty_bin(b)
            pooled = F.adaptive_avg_pool1d(xb.transpose(1, 2), pooling.m)
        else:
            img = xb.transpose(1, 2).unflatten(-1, grid)  # (H, D, *grid)
            adaptive_pool = _ADAPTIVE_POOL[len(grid)]
            if real is None:
                pooled = adaptive_pool(img, pooling.shape)
            else:  # mean over the real tokens of each bin
                w = real.to(x.dtype).view(1, 1, *grid)
                den = adaptive_pool(w, pooling.shape)
                if bool((den == 0).any()):
                    raise _empty_bin(b)
                pooled = adaptive_pool(img.masked_fill(~real.view(1, 1, *grid), 0), pooling.shape) / den
        out.append(pooled.flatten(2).transpose(1, 2))
    return torch.stack(out)


def pooling_matrix(n: int, m: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(m, n) averaging weights with the bin edges of ``adaptive_avg_pool1d``."""
    i = torch.arange(m, device=device)
    start = (i * n) // m
    end = ((i + 1) * n + m - 1) // m
    t = torch.arange(n, device=device)
    w = ((t >= start[:, None]) & (t < end[:, None])).to(dtype)
    return w / (end - start).to(dtype)[:, None]


@functools.lru_cache(maxsize=64)
def pool_bins(pooling: Pooling, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unmasked pooling of a sequence of n tokens as bins, for kernels that pool themselves.

    Returns (offsets, tokens), int64 CPU tensors: bin i (in the row-major order of the bins)
    holds the token positions ``tokens[offsets[i]:offsets[i + 1]]`` (prefix tokens counted, so
    positions index the whole sequence; suffix tokens are in no bin), in row-major order: the bins and order of
    ``adaptive_avg_pool1d/2d/3d``. Cached per shape; callers must not modify them.
    """
    grid = pooling.grid or (n - pooling.num_prefix_tokens - pooling.num_suffix_tokens,)
    edges = []
    for g, s in zip(grid, pooling.shape):
        i = torch.arange(s)
        edges.append(list(zip(((i * g) // s).tolist(), (((i + 1) * g + s - 1) // s).tolist())))
    position = torch.arange(math.prod(grid)).view(grid) + pooling.num_prefix_tokens
    bins = [position[tuple(slice(a, b) for a, b in box)].flatten() for box in itertools.product(*edges)]
    offsets = torch.tensor([0, *itertools.accumulate(len(b) for b in bins)])
    return offsets, torch.cat(bins)


def pool(x: torch.Tensor, pooling: Pooling, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pool x (B, H, N, D) to (B, H, m, D) in O(m N D) per head; ``mask`` (B, N) marks the real tokens."""
    span = pooling.span(x.shape[2])
    x = x[:, :, span]
    B, H, L, D = x.shape
    m, grid = pooling.m, pooling.grid
    real = None if mask is None else mask[:, span]
    if real is None:
        if grid is None and L % m == 0:
            return x.unflatten(2, (m, L // m)).mean(3)
        img = x.flatten(0, 1).transpose(1, 2)  # (B H, D, L)
        if grid is not None:
            img = img.unflatten(2, grid)
        pooled = _ADAPTIVE_POOL[len(pooling.shape)](img, pooling.shape)
        return pooled.flatten(2).transpose(1, 2).reshape(B, H, m, D)
    x = x.masked_fill(~real[:, None, :, None], 0)  # zero weights alone would let NaN through (0 * NaN = NaN)
    if grid is None:  # bins over each sequence's real tokens: the bin of a token is the bin of its rank
        n_real = real.sum(1)  # (B,)
        rank = real.cumsum(1) - 1  # (B, L)
        i = torch.arange(m, device=x.device)
        start = (i[None] * n_real[:, None]) // m  # (B, m)
        end = ((i[None] + 1) * n_real[:, None] + m - 1) // m
        w = (rank[:, None] >= start[..., None]) & (rank[:, None] < end[..., None]) & real[:, None]
        w = w.to(x.dtype) / (end - start).clamp(min=1).to(x.dtype)[..., None]  # (B, m, L)
        require(n_real > 0, _empty_bin)
        return w[:, None] @ x
    w = pooling_matrix(grid[0], pooling.shape[0], x.device, x.dtype)
    for g, s in zip(grid[1:], pooling.shape[1:]):
        w = torch.kron(w, pooling_matrix(g, s, x.device, x.dtype))
    w = w[None] * real[:, None].to(x.dtype)  # (B, m, L): mean over the real tokens of each bin
    den = w.sum(-1, keepdim=True)
    require(den > 0, _empty_bin)
    return (w / den)[:, None] @ x
