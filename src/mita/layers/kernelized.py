"""Layers of the kernelized linear attentions with learned parts: FLatten, PolaFormer and InLine.

Each is a drop-in for timm's ``Attention`` (same arguments and ``qkv``/``proj`` names) that adds
its method's parameters, in modules of their own (``feature_scale``, ``power``, ``dwc``,
``residual``): a timm state dict loads with ``strict=False``, missing exactly those, and
``mita.convert`` moves them along (and refuses to drop them).
The convolutions on V run over the tokens between ``num_prefix_tokens`` and ``num_suffix_tokens``, on
``grid`` ((gh, gw), (gt, gh, gw), "auto" for a square of patches) or, with ``grid=None``, along the
sequence; they are zero on the prefix and suffix tokens and padded tokens take no part.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.checks import check_int
from ..ops.flatten import focused_linear_attention
from ..ops.inline import inline_attention
from ..ops.kernelized import check_positive
from ..ops.polaformer import polarity_linear_attention
from .base import (
    AttentionLayer,
    GridOption,
    PatchGrid,
    check_grid_option,
    depthwise_conv,
    layout_dims,
    padding_mask,
    resolve_grid,
)


def _tokens(
    v: torch.Tensor, span: tuple[int, int], grid: tuple[int, ...] | None, mask: torch.Tensor | None
) -> torch.Tensor:
    """V's tokens between the prefix and the suffix (``span``: their counts) as (B, H, D, *layout);
    padded tokens zero."""
    if mask is not None:
        v = v.masked_fill(~mask[:, None, :, None], 0)
    x = v[:, :, span[0] : v.shape[2] - span[1]].transpose(-1, -2)
    return x if grid is None else x.unflatten(-1, grid)


def _back(x: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """(B, H, D, *layout) back to (B, H, N, D) with zero rows for the prefix and suffix tokens."""
    x = x.flatten(3).transpose(-1, -2)
    return F.pad(x, (0, 0, *span))


def _plus(out: torch.Tensor, extra: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``out + extra`` (both (B, H, N, D)) with the rows of padded tokens (``mask`` (B, N) False) zero again."""
    out = out + extra
    return out if mask is None else out.masked_fill(~mask[:, None, :, None], 0)


class _LayoutAttention(AttentionLayer):
    """An :class:`AttentionLayer` that knows its token layout (for a convolution on V): ``grid``,
    ``num_prefix_tokens`` and ``num_suffix_tokens``, options of every layer built on it."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        grid: GridOption = None,
        num_prefix_tokens: int = 0,
        num_suffix_tokens: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dim, num_heads, *args, num_prefix_tokens=num_prefix_tokens, num_suffix_tokens=num_suffix_tokens, **kwargs
        )
        self.grid = check_grid_option(grid)
        self.patch_grid: PatchGrid | None = None  # the running forward's patch grid (models of varying image size)

    @property
    def span(self) -> tuple[int, int]:
        """The counts of the prefix and suffix tokens, outside the layout."""
        return self.num_prefix_tokens, self.num_suffix_tokens

    def resolve_grid(self, n: int) -> tuple[int, ...] | None:
        """The grid for a sequence of n tokens: the running forward's patch grid, or ``grid`` ("auto": a square)."""
        return resolve_grid(self.grid, n, self.num_prefix_tokens, self.patch_grid, self.num_suffix_tokens)

    def extra_repr(self) -> str:
        return (
            f"grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}, num_suffix_tokens={self.num_suffix_tokens}"
        )


class _ConvAttention(_LayoutAttention):
    """A :class:`_LayoutAttention` with an optional depth-wise convolution of V added to its output
    (FLatten's rank restoration module, PolaFormer's convolution): options ``dwc`` and ``kernel_size``."""

    def __init__(
        self, dim: int, num_heads: int = 8, *args: Any, dwc: bool = False, kernel_size: int = 5, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        # one head's D channels, each its own kernel, shared by the heads
        self.dwc = depthwise_conv(self.head_dim, self.grid, self.dd, _kernel_size(kernel_size)) if dwc else None

    def with_dwc(self, out: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``out`` (B, H, N, D) plus the convolution of each head of V (B, H, N, D) over the layout (zero on the
        prefix and suffix tokens), padded rows zero; ``out`` itself without ``dwc``."""
        if self.dwc is None:
            return out
        B, H, N, _ = v.shape
        x = _tokens(v, self.span, self.resolve_grid(N), mask)
        return _plus(out, _back(self.dwc(x.flatten(0, 1)).unflatten(0, (B, H)), self.span), mask)


class FeatureScale(nn.Module):
    """A learned per-(head, channel) scale s = softplus(theta) > 0, theta zero at initialisation (s = log 2)."""

    def __init__(self, num_heads: int, head_dim: int, dd: dict) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(num_heads, head_dim, **dd))

    def forward(self) -> torch.Tensor:
        return F.softplus(self.theta)


class LearnedPower(nn.Module):
    """PolaFormer's learned per-(head, channel) exponent p = 1 + alpha sigmoid(theta), theta zero at
    initialisation (p = 1 + alpha / 2)."""

    def __init__(self, num_heads: int, head_dim: int, alpha: float, dd: dict) -> None:
        super().__init__()
        self.alpha = alpha
        self.theta = nn.Parameter(torch.zeros(num_heads, head_dim, **dd))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"

    def forward(self) -> torch.Tensor:
        return 1 + self.alpha * torch.sigmoid(self.theta)


def _kernel_size(value: object) -> int:
    n = check_int("kernel_size", value)
    if n % 2 == 0:
        raise ValueError(f"kernel_size must be an odd int >= 1 (a centred kernel), got {value!r}")
    return n


class FLattenAttention(_ConvAttention):
    """Focused linear attention (Han et al., ICCV 2023); a drop-in for timm's ``Attention``.

    The per-channel feature scale s = softplus(theta) is learned (``feature_scale``: theta (H, D),
    zero at initialisation as in the authors' code). ``dwc`` adds the paper's rank
    restoration module, a depth-wise convolution of V (kernel 5, one kernel per channel shared
    by the heads) to the output. Its default is off, the setting of the MiTA authors' ImageNet
    comparison code (QishuaiWen/MiTA, ``MiTA-DeiT/mita/focused_linear_attention.py``: the
    convolution is commented out there, for a comparison without convolutions).

    Args (besides timm's):
        focusing_factor (float): p of the focusing function. Default: 3.0 (the paper's).
        dwc (bool): add the depth-wise convolution of V. Default: False.
        kernel_size (int): its kernel, odd. Default: 5 (the paper's).
        grid, num_prefix_tokens, num_suffix_tokens: the token layout of the convolution (see the module).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        focusing_factor: float = 3.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        self.focusing_factor = check_positive("focusing_factor", focusing_factor)
        self.feature_scale = FeatureScale(num_heads, self.head_dim, self.dd)

    def extra_repr(self) -> str:
        return f"focusing_factor={self.focusing_factor}, {super().extra_repr()}"

    def attend(self, q, k, v, key_padding_mask, is_causal):
        out = focused_linear_attention(
            q,
            k,
            v,
            focusing_factor=self.focusing_factor,
            feature_scale=self.feature_scale(),
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
        )
        return self.with_dwc(out, v, key_padding_mask)


class PolaAttention(_ConvAttention):
    """Polarity-aware linear attention (Meng et al., ICLR 2025); a drop-in for timm's ``Attention``.

    Learned per-channel exponent p = 1 + alpha sigmoid(theta) (``power``: theta (H, D), zero at
    initialisation: p = 3 with the paper's alpha = 4) and feature scale s (``feature_scale``).
    ``dwc`` adds the depth-wise convolution of V (kernel 5) of the authors' full model; off by
    default, the setting of the MiTA authors' comparison (QishuaiWen/MiTA, ``mita/PoLA.py``: the
    comment there: PolaFormer's Table 3 model without convolution and gate).

    Args (besides timm's):
        alpha (float): the range of the learned exponent, p in (1, 1 + alpha). Default: 4.0.
        dwc (bool): add the depth-wise convolution of V. Default: False.
        kernel_size (int): its kernel, odd. Default: 5.
        grid, num_prefix_tokens, num_suffix_tokens: the token layout of the convolution (see the module).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        alpha: float = 4.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        self.power = LearnedPower(num_heads, self.head_dim, check_positive("alpha", alpha), self.dd)
        self.feature_scale = FeatureScale(num_heads, self.head_dim, self.dd)

    def attend(self, q, k, v, key_padding_mask, is_causal):
        out = polarity_linear_attention(
            q,
            k,
            v,
            power=self.power(),
            feature_scale=self.feature_scale(),
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
        )
        return self.with_dwc(out, v, key_padding_mask)


class InLineAttention(_LayoutAttention):
    """Injective linear attention (Han et al., NeurIPS 2024); a drop-in for timm's ``Attention``.

    ``local_residual`` adds the paper's local residual term: a depth-wise 3x3 convolution of V
    (3 taps along a 1-D sequence, 3x3x3 on a 3-D grid) whose kernels, one per channel, are
    predicted from the mean of the layer's input tokens (over the real ones) by a head-wise
    MLP (1x1 grouped convolution, GELU, 1x1 grouped convolution to 9 taps a channel), as in the
    authors' DeiT code. On by default: the MiTA authors' comparison keeps it
    (QishuaiWen/MiTA, ``mita/inline_attention.py``).

    Args (besides timm's):
        local_residual (bool): add the local residual term. Default: True.
        grid, num_prefix_tokens, num_suffix_tokens: the token layout of the convolution (see the module).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        local_residual: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        c, taps = self.attn_dim, 3 ** layout_dims(self.grid)
        self.residual = None
        if local_residual:
            self.residual = nn.Sequential(
                # head-wise channel mixing (dim splits into the heads in timm's layers; else as finely as it does)
                nn.Conv1d(dim, c, 1, groups=math.gcd(dim, num_heads), **self.dd),
                nn.GELU(),
                nn.Conv1d(c, c * taps, 1, groups=num_heads, **self.dd),
            )
        self._kernels: torch.Tensor | None = None  # (B, C * taps) of the running forward

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.residual is not None and isinstance(x, torch.Tensor) and x.dim() == 3:
            mask = padding_mask(attn_mask, x.shape[0], x.shape[1])
            if mask is None:
                mean = x.mean(1)
            else:  # the mean of the real tokens; masked_fill, as a padded token may hold NaN
                mean = x.masked_fill(~mask[..., None], 0).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            self._kernels = self.residual(mean.unsqueeze(-1)).squeeze(-1)
        try:
            return super().forward(x, attn_mask, is_causal, rope=rope)
        finally:
            self._kernels = None

    def attend(self, q, k, v, key_padding_mask, is_causal):
        out = inline_attention(
            q,
            k,
            v,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
        )
        if self._kernels is None:
            return out
        B, H, N, D = v.shape
        grid = self.resolve_grid(N)
        x = _tokens(v, self.span, grid, key_padding_mask).reshape(1, B * H * D, *(grid or (-1,)))
        dims = x.dim() - 2
        weight = self._kernels.reshape(B * H * D, 1, *(3,) * dims)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
        local = conv(x, weight, padding=1, groups=B * H * D).view(B, H, D, *x.shape[2:])
        return _plus(out, _back(local, self.span), key_padding_mask)
