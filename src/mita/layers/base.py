"""A drop-in for timm's ``Attention`` (and ``AttentionRope`` / ``EvaAttention``) whose attention op
is chosen by the subclass.

Constructor arguments, parameter names (``qkv`` or ``q_proj``/``k_proj``/``v_proj``, ``q_bias``/``v_bias``,
``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``) and ``forward(x, attn_mask=None, is_causal=False,
*, rope=None)`` are timm's (1.0.x), so state dicts move between timm models and these layers unchanged.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.checks import check_dropout, check_int
from ..ops.pooling import check_pooling

GridOption = tuple[int, ...] | Literal["auto"] | None


def padding_mask(attn_mask: torch.Tensor | None, B: int, N: int) -> torch.Tensor | None:
    """Check that ``attn_mask`` is a bool key padding mask (B, N), True = real token."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool or tuple(attn_mask.shape) != (B, N):
        got = f"{attn_mask.dtype} {tuple(attn_mask.shape)}" if isinstance(attn_mask, torch.Tensor) else type(attn_mask)
        raise ValueError(f"attn_mask must be a bool padding mask of shape (B={B}, N={N}), True = real token; got {got}")
    return attn_mask


def check_grid_option(grid: object) -> GridOption:
    """A layer's ``grid``: None (1-D), "auto" (a square of the pooled tokens), (gh, gw) or (gt, gh, gw) of ints >= 1."""
    if grid is None or (isinstance(grid, str) and grid == "auto"):
        return grid
    if isinstance(grid, (tuple, list)) and len(grid) in (2, 3):
        try:
            return tuple(check_int("grid", g) for g in grid)
        except ValueError:
            pass
    raise ValueError(f"grid must be None, 'auto', (gh, gw) or (gt, gh, gw) of ints >= 1, got {grid!r}")


def check_bins(name: str, value: object, grid: GridOption) -> int | tuple[int, ...]:
    """``num_landmarks`` / ``num_agents`` for a layer's grid, checked as its op checks them per call:
    an int >= 1 in 1-D; (mh, mw) or a perfect square on a 2-D grid ("auto" included); (mt, mh, mw)
    or a perfect cube on a 3-D one. Returns ints (a tuple stays a tuple)."""
    dims = None if grid is None else 2 if grid == "auto" else len(grid)
    shape = check_pooling(value, None if dims is None else (1,) * dims, 0, 1, name=name).shape
    return shape if isinstance(value, (tuple, list)) else math.prod(shape)


def check_rate(name: str, value: object) -> float:
    """A dropout rate in [0, 1), checked as the ops check ``dropout_p``, with ``name`` in the message."""
    try:
        return check_dropout(value)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("dropout_p", name, 1)) from None


class PatchGrid:
    """The patch grid (gh, gw) of the image a model is running on, recorded per forward and per thread.

    A model whose image size changes from call to call (timm's ``dynamic_img_size``, Hugging
    Face's ``interpolate_pos_encoding``) records it from a hook on its patch embedding, and its
    layers pool each input on that grid instead of the one of the size the model was built for.
    Thread-local, so concurrent forwards of one model (or its ``DataParallel`` replicas) do not mix.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def current(self) -> tuple[int, ...] | None:
        """The grid of the running forward in this thread (None before the first)."""
        return getattr(self._local, "grid", None)

    @current.setter
    def current(self, grid: tuple[int, ...] | None) -> None:
        self._local.grid = None if grid is None else tuple(int(g) for g in grid)

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a copy (deepcopy, pickle) starts with no grid recorded

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()


def resolve_grid(
    grid: GridOption,
    n: int,
    num_prefix_tokens: int,
    patch_grid: PatchGrid | None = None,
    num_suffix_tokens: int = 0,
) -> tuple[int, ...] | None:
    """The grid of a sequence of n tokens.

    A layer that pools on a 2-D grid takes the patch grid of the running forward when
    ``patch_grid`` has one and the n - num_prefix_tokens - num_suffix_tokens pooled tokens are
    that grid; otherwise ``grid`` itself, or for "auto" a square of the pooled tokens. "auto" is
    for images; video layouts pass their (gt, gh, gw) grid explicitly.
    """
    pooled = n - num_prefix_tokens - num_suffix_tokens
    pools_2d = grid == "auto" or (grid is not None and len(grid) == 2)
    live = patch_grid.current if patch_grid is not None and pools_2d else None
    if live is not None and math.prod(live) == pooled:
        return live
    if grid != "auto":
        return None if grid is None else tuple(grid)
    side = math.isqrt(max(pooled, 0))
    if side * side != pooled or side == 0:
        raise ValueError(
            f"grid='auto' needs a square number of pooled tokens, got N - num_prefix_tokens - num_suffix_tokens = "
            f"{n} - {num_prefix_tokens} - {num_suffix_tokens}; pass grid=(gh, gw), or (gt, gh, gw) for video"
        )
    return side, side


def layout_dims(grid: GridOption) -> int:
    """Spatial dimensions of a layout: 1 along the sequence, 2 for "auto" or (gh, gw), 3 for (gt, gh, gw)."""
    return 1 if grid is None else 2 if grid == "auto" else len(grid)


def depthwise_conv(channels: int, grid: GridOption, dd: dict, kernel_size: int = 3) -> nn.Module:
    """A depth-wise convolution of ``channels`` channels, kernel ``kernel_size`` (odd; default 3) in every
    dimension of the layout (:func:`layout_dims`), padded to keep the layout's size."""
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[layout_dims(grid)]
    return conv(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, **dd)


def conv_values(
    conv: nn.Module,
    v: torch.Tensor,
    num_prefix_tokens: int,
    grid: tuple[int, ...] | None,
    key_padding_mask: torch.Tensor | None = None,
    num_suffix_tokens: int = 0,
) -> torch.Tensor:
    """The depth-wise convolution of V (B, H, N, D) over the tokens between the prefix and the suffix;
    zero on the prefix and suffix tokens.

    Padded tokens are zeroed first. Returns (B, H, N, D).
    """
    B, H, N, D = v.shape
    if key_padding_mask is not None:
        v = v.masked_fill(~key_padding_mask[:, None, :, None], 0)
    x = v[:, :, num_prefix_tokens : N - num_suffix_tokens].transpose(-1, -2).reshape(B, H * D, -1)
    x = conv(x if grid is None else x.unflatten(-1, grid)).reshape(B, H, D, -1).transpose(-1, -2)
    return F.pad(x, (0, 0, num_prefix_tokens, num_suffix_tokens))


def check_rope(rope: object, q: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """``rope`` for q (B, H, N, D): a tensor (..., N - num_prefix_tokens, 2 D), sin then cos (timm's layout)."""
    n, d = q.shape[2] - num_prefix_tokens, q.shape[3]
    if not isinstance(rope, torch.Tensor) or rope.dim() < 2 or rope.shape[-2:] != (n, 2 * d):
        got = tuple(rope.shape) if isinstance(rope, torch.Tensor) else type(rope).__name__
        raise ValueError(
            f"rope must be a tensor (..., N - num_prefix_tokens, 2 * head_dim) = (..., {n}, {2 * d}) of sines then "
            f"cosines (timm's RotaryEmbeddingCat.get_embed()), got {got}; num_prefix_tokens={num_prefix_tokens}"
        )
    if not rope.is_floating_point():
        raise TypeError(f"rope must be a floating-point tensor, got {rope.dtype}")
    return rope


def rotate(x: torch.Tensor, rope: torch.Tensor, half: bool) -> torch.Tensor:
    """Rotary position embedding of x (..., n, D) by ``rope`` (..., n, 2 D) = [sin, cos], in x's dtype.

    Pairs are adjacent channels (2i, 2i + 1) by default, or the two halves (i, i + D/2) with
    ``half`` (timm's ``rotate_half``). The product is formed in the promoted dtype of x and rope
    and only the result is cast back, as timm's ``apply_rot_embed_cat`` does.
    """
    sin, cos = rope.chunk(2, dim=-1)
    if half:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    else:
        turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return (x * cos + turned * sin).to(x.dtype)


class AttentionLayer(nn.Module):
    """timm-compatible multi-head self-attention; subclasses implement :meth:`attend`.

    The positional arguments are timm's ``Attention``'s; the keyword-only ones take the layouts
    of timm's ``AttentionRope`` and ``EvaAttention`` (separate projections, grouped key/value
    heads, EVA's bias-free key, the rotary pairing, the tokens RoPE leaves alone), so the state
    dict of any of the three loads unchanged.

    Args:
        dim (int): token width C of the input (B, N, C).
        num_heads (int): attention heads H. Default: 8.
        attn_head_dim (int | None): D; None takes dim // num_heads. Default: None.
        dim_out (int | None): output width; None takes dim. Default: None.
        qkv_bias (bool): bias in the q, k, v projections. Default: False.
        qk_norm (bool): normalise q and k per head with ``norm_layer``. Default: False.
        scale_norm (bool): normalise the attention output with ``norm_layer``. Default: False.
        proj_bias (bool): bias in the output projection. Default: True.
        gated (bool): a sigmoid gate from x on the attention output. Default: False.
        attn_drop (float): dropout on the attention probabilities in training. Default: 0.0.
        proj_drop (float): dropout after the output projection. Default: 0.0.
        norm_layer (type | None): the norm of ``qk_norm`` / ``scale_norm``. Default: None.
        device (torch.device | str | None): of the parameters. Default: None.
        dtype (torch.dtype | None): of the parameters. Default: None.
        qkv_fused (bool): one ``qkv`` projection; False: ``q_proj``, ``k_proj``, ``v_proj``. Default: True.
        num_kv_heads (int | None): key/value heads Hkv (grouped-query attention, a divisor of num_heads;
            needs ``qkv_fused=False``); None takes num_heads. Default: None.
        key_bias (bool): with ``qkv_bias``, a bias on k too; False is EVA's layout: a bias-free ``qkv``
            beside ``q_bias`` and ``v_bias`` parameters (or a bias-free ``k_proj``). Default: True.
        rotate_half (bool): RoPE pairs channel i with i + D/2; False pairs 2i with 2i + 1. Default: False.
        num_prefix_tokens (int): leading tokens (CLS, registers) that RoPE leaves unrotated; the
            layers that pool leave them unpooled too. Default: 0.
        num_suffix_tokens (int): trailing tokens (ViT-5's registers) that the layers that pool leave
            unpooled (RoPE rotates them, by the rows ``rope`` gives them). Default: 0.
    """

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
        *,
        qkv_fused: bool = True,
        num_kv_heads: int | None = None,
        key_bias: bool = True,
        rotate_half: bool = False,
        num_prefix_tokens: int = 0,
        num_suffix_tokens: int = 0,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        dim, num_heads = check_int("dim", dim), check_int("num_heads", num_heads)
        if attn_head_dim is not None:
            attn_head_dim = check_int("attn_head_dim", attn_head_dim)
        if dim_out is not None:
            dim_out = check_int("dim_out", dim_out)
        attn_drop, proj_drop = check_rate("attn_drop", attn_drop), check_rate("proj_drop", proj_drop)
        if attn_head_dim is None and dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads} (or pass attn_head_dim)")
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("qk_norm and scale_norm need a norm_layer, e.g. norm_layer=nn.LayerNorm")
        for name, flag in (("qkv_fused", qkv_fused), ("key_bias", key_bias), ("rotate_half", rotate_half)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {type(flag).__name__} {flag!r}")
        num_kv_heads = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads or (qkv_fused and num_kv_heads != num_heads):
            raise ValueError(
                f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}, and differ from it only with "
                "qkv_fused=False (separate q, k, v projections)"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = attn_head_dim or dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.rotate_half = rotate_half
        self.num_prefix_tokens = check_int("num_prefix_tokens", num_prefix_tokens, 0)
        self.num_suffix_tokens = check_int("num_suffix_tokens", num_suffix_tokens, 0)
        kv_dim = num_kv_heads * self.head_dim
        self.qkv = self.q_proj = self.k_proj = self.v_proj = self.q_bias = self.v_bias = None
        if qkv_fused:
            self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias and key_bias, **dd)
            if qkv_bias and not key_bias:  # EVA: q and v biases beside a bias-free qkv, k's bias is zero
                self.q_bias = nn.Parameter(torch.zeros(self.attn_dim, **dd))
                self.v_bias = nn.Parameter(torch.zeros(self.attn_dim, **dd))
        else:
            self.q_proj = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd)
            self.k_proj = nn.Linear(dim, kv_dim, bias=qkv_bias and key_bias, **dd)
            self.v_proj = nn.Linear(dim, kv_dim, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def dd(self) -> dict:
        """The device and dtype of the layer's parameters, for the ones a subclass adds."""
        weight = self.proj.weight
        return {"device": weight.device, "dtype": weight.dtype}

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None, is_causal: bool
    ) -> torch.Tensor:
        """Attention on (B, H, N, D) heads; the one method a subclass writes."""
        raise NotImplementedError

    @property
    def dropout_p(self) -> float:
        return self.attn_drop.p if self.training else 0.0

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, N, D) and k, v (B, Hkv, N, D) of x (B, N, C), before the q/k norms."""
        B, N, _ = x.shape
        if self.qkv is None:
            q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
            return q, k, v
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv = F.linear(x, self.qkv.weight, torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]))
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def apply_rope(self, q: torch.Tensor, k: torch.Tensor, rope: object) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k with ``rope`` applied to the tokens after the prefix, as timm's ``AttentionRope`` does."""
        p = self.num_prefix_tokens
        rope = check_rope(rope, q, p)
        q, k = (torch.cat([t[:, :, :p], rotate(t[:, :, p:], rope, self.rotate_half)], dim=2) for t in (q, k))
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention of x (B, N, C); ``attn_mask`` bool (B, N), True = real token; ``rope`` the rotary
        embedding of the tokens after the prefix, (..., N - num_prefix_tokens, 2 D) sines then cosines, as
        timm's ``AttentionRope`` takes it (applied to q and k after their norms). Returns (B, N, dim_out)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__} takes x of shape (B, N, C), got {got}; add a batch dimension")
        B, N, _ = x.shape
        mask = padding_mask(attn_mask, B, N)
        if is_causal and not self.supports_causal:
            raise NotImplementedError(f"{type(self).__name__} has no causal form yet; use is_causal=False")
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = self.apply_rope(q, k, rope)
            q, k = q.type_as(v), k.type_as(v)
        if self.num_kv_heads != self.num_heads:  # each kv head serves num_heads / num_kv_heads query heads
            k, v = (t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1) for t in (k, v))
        x = self.attend(q, k, v, mask, is_causal).transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))
