"""A drop-in for timm's ``Attention`` whose attention op is chosen by the subclass.

Constructor arguments, parameter names (``qkv``, ``q_norm``, ``k_norm``, ``norm``,
``gate``, ``proj``) and ``forward(x, attn_mask=None, is_causal=False)`` are timm's
(1.0.x), so state dicts move between timm models and these layers unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def padding_mask(attn_mask: torch.Tensor | None, B: int, N: int) -> torch.Tensor | None:
    """Check that ``attn_mask`` is a bool key padding mask (B, N), True = real token."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (B, N):
        got = f"{attn_mask.dtype} {tuple(attn_mask.shape)}" if isinstance(attn_mask, torch.Tensor) else type(attn_mask)
        raise ValueError(f"attn_mask must be a bool padding mask of shape (B={B}, N={N}), True = real token; got {got}")
    return attn_mask


class AttentionLayer(nn.Module):
    """timm-compatible multi-head self-attention; subclasses implement :meth:`attend`."""

    supports_causal = False

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if attn_head_dim is None and dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads} (or pass attn_head_dim)")
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("qk_norm and scale_norm need a norm_layer, e.g. norm_layer=nn.LayerNorm")
        self.num_heads = num_heads
        self.head_dim = attn_head_dim or dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        """Attention on (B, H, N, D) heads; the one method a subclass writes."""
        raise NotImplementedError

    @property
    def dropout_p(self) -> float:
        return self.attn_drop.p if self.training else 0.0

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        B, N, _ = x.shape
        mask = padding_mask(attn_mask, B, N)
        if is_causal and not self.supports_causal:
            raise NotImplementedError(f"{type(self).__name__} has no causal form yet; use is_causal=False")
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = self.attend(q, k, v, mask, is_causal).transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))
