"""ViT-5 (Wang et al., arXiv 2602.08071) and the MiTA authors' MiTA-ViT-5, in timm's registry.

ViT-5 keeps the ViT encoder and modernises its parts: four register tokens at the *end* of the
sequence (after the patches), 2-D rotary position embeddings on q and k (the patches on their
grid, theta 10,000; the registers on a 2x2 grid of their own, theta 100; the CLS token
unrotated), q and k normalised per head by RMSNorm, RMSNorm and layer scale (1e-4) in the blocks,
no qkv bias, a learned absolute position embedding on the patches, and the CLS token's output
as the image's feature.

The blocks are timm's ``EvaBlock`` with its ``AttentionRope`` (which takes ``rope=`` from the
model at every block), so ``mita.convert`` swaps their attention like any timm RoPE ViT's:
``mita_vit5_*`` are ViT-5 converted to MiTA with the MiTA authors' settings (m = 25 landmarks
pooled from the rotated patch queries only, on the 14x14 grid, k = 30 keys, s = 1), the
registers and CLS token taking part as queries, keys and values but not pooled
(``num_prefix_tokens=1``, ``num_suffix_tokens=4``). ``compat="official"`` adds their landmark
logits at 1/D, so their checkpoints evaluate as theirs do; parameter names are theirs
(``blocks.i.attn.qkv``, ``q_norm``, ``k_norm``, ``gamma_1``, ``reg_token``, ``dwc``, ...), and
the constant frequency buffers of their RoPE modules in a checkpoint are dropped on load.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

import torch
import torch.nn as nn
from timm.layers import PatchEmbed, RmsNorm, resample_abs_pos_embed, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.eva import EvaBlock

from ..ops.checks import check_int
from . import convert as conversion  # the module, not its function (see deit.py)
from .weights import load_local_checkpoint, pretrained_cfg

__all__ = ["MITA_OPTIONS", "MODEL_NAMES", "ViT5", "ViT5RotaryEmbedding", "checkpoint_filter_fn"]

#: MiTA options a ``mita_vit5_*`` entry point accepts (the rest goes to :class:`ViT5`)
MITA_OPTIONS = ("num_landmarks", "topk", "num_routed", "compat", "branches", "impl", "dwc", "out_gate")


def _axis_angles(length: int, reference: int, dim: int, theta: float) -> torch.Tensor:
    """(length, dim) rotation angles of one axis: dim / 2 frequencies, each for a channel pair.

    Positions are 0..length-1 rescaled to the reference length (an image larger than the one
    trained on spans the same range of angles, as in the ViT-5 authors' code).
    """
    freqs = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32)[: dim // 2] / dim)
    positions = torch.arange(length, dtype=torch.float32) * (reference / length)
    return torch.outer(positions, freqs).repeat_interleave(2, dim=-1)


def grid_rope(grid: tuple[int, int], reference: tuple[int, int], head_dim: int, theta: float) -> torch.Tensor:
    """2-D RoPE of a row-major (gh, gw) grid for heads of ``head_dim`` channels (a multiple of 4).

    The first half of the channels turns with the row, the second with the column; adjacent
    channels (2i, 2i + 1) form the rotated pairs. Returns (gh * gw, 2 * head_dim): the sines,
    then the cosines (timm's ``rope=`` layout, ``rotate_half=False``).
    """
    (gh, gw), half = grid, head_dim // 2
    rows = _axis_angles(gh, reference[0], half, theta)[:, None, :].expand(gh, gw, half)
    cols = _axis_angles(gw, reference[1], half, theta)[None, :, :].expand(gh, gw, half)
    angles = torch.cat([rows, cols], dim=-1).reshape(gh * gw, head_dim)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ViT5RotaryEmbedding(nn.Module):
    """ViT-5's rotary embedding of every token after the CLS token: the patches, then the registers.

    Args:
        head_dim (int): D, a multiple of 4.
        reference_grid (tuple[int, int]): the patch grid the model is built for (positions of
            other grids are rescaled to it).
        num_registers (int): registers after the patches, a perfect square (ViT-5: 4, on 2x2). Default: 4.
        theta (float): the patches' base. Default: 10000.0.
        register_theta (float): the registers' base. Default: 100.0.
    """

    def __init__(
        self,
        head_dim: int,
        reference_grid: tuple[int, int],
        num_registers: int = 4,
        theta: float = 10000.0,
        register_theta: float = 100.0,
    ) -> None:
        super().__init__()
        if check_int("head_dim", head_dim) % 4:
            raise ValueError(f"2-D RoPE needs a head dim that is a multiple of 4, got head_dim={head_dim}")
        side = math.isqrt(check_int("num_registers", num_registers, 0))
        if side * side != num_registers:
            raise ValueError(f"num_registers must be a perfect square (they sit on a square grid), got {num_registers}")
        self.head_dim, self.reference_grid = head_dim, tuple(reference_grid)
        self.register_grid, self.theta, self.register_theta = (side, side), float(theta), float(register_theta)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, reference_grid={self.reference_grid}, register_grid={self.register_grid}"

    def forward(self, grid: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
        """(gh * gw + num_registers, 2 * head_dim) float32: sines then cosines of each token after the CLS."""
        patches = grid_rope(grid, self.reference_grid, self.head_dim, self.theta)
        registers = grid_rope(self.register_grid, self.register_grid, self.head_dim, self.register_theta)
        return torch.cat([patches, registers[: math.prod(self.register_grid)]]).to(device)


class ViT5(nn.Module):
    """ViT-5: CLS token, patches, registers; 2-D RoPE; RMSNorm, qk-norm and layer scale (see the module).

    Args:
        img_size (int | tuple): the image size the model is built for. Default: 224.
        patch_size (int): Default: 16.
        in_chans (int): Default: 3.
        num_classes (int): classes of the head; 0 for no head. Default: 1000.
        global_pool (str): "token" (the CLS token's output, ViT-5's) or "avg" (the mean of the patches').
            Default: "token".
        embed_dim (int): Default: 768.
        depth (int): Default: 12.
        num_heads (int): Default: 12.
        mlp_ratio (float): Default: 4.0.
        qkv_bias (bool): Default: False.
        num_registers (int): register tokens after the patches, a perfect square. Default: 4.
        rope_theta (float): RoPE base of the patches. Default: 1e4.
        register_theta (float): RoPE base of the registers (on a grid of their own). Default: 100.
        init_values (float | None): layer-scale initial value; None for no layer scale. Default: 1e-4.
        drop_rate (float): dropout before the head. Default: 0.0.
        proj_drop_rate (float): dropout after each block's attention projection. Default: 0.0.
        attn_drop_rate (float): dropout on the attention probabilities. Default: 0.0.
        drop_path_rate (float): stochastic depth, the same rate in every block (as ViT-5's). Default: 0.0.
        dynamic_img_size (bool): take images of any size (multiples of the patch): the position
            embedding is resampled and RoPE's positions rescaled to the new grid. Default: False.
        device (torch.device | str | None): of the parameters. Default: None.
        dtype (torch.dtype | None): of the parameters. Default: None.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: Literal["token", "avg"] = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        num_registers: int = 4,
        rope_theta: float = 10000.0,
        register_theta: float = 100.0,
        init_values: float | None = 1e-4,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dynamic_img_size: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
        embed_dim, num_heads = check_int("embed_dim", embed_dim), check_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        norm_layer = partial(RmsNorm, eps=1e-6)
        self.num_classes, self.global_pool = check_int("num_classes", num_classes, 0), global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens, self.num_suffix_tokens = 1, check_int("num_registers", num_registers, 0)
        self.dynamic_img_size, self.grad_checkpointing = bool(dynamic_img_size), False
        embed_args = {"strict_img_size": False, "output_fmt": "NHWC"} if dynamic_img_size else {}
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, **embed_args, **dd)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **dd))
        self.reg_token = nn.Parameter(torch.zeros(1, num_registers, embed_dim, **dd)) if num_registers else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim, **dd))
        self.rope = ViT5RotaryEmbedding(
            embed_dim // num_heads, self.patch_embed.grid_size, num_registers, rope_theta, register_theta
        )
        self.blocks = nn.ModuleList(
            EvaBlock(
                embed_dim,
                num_heads,
                qkv_bias=qkv_bias,
                mlp_ratio=mlp_ratio,
                num_prefix_tokens=1,  # the CLS token is not rotated; the registers are, by their own rows of rope
                attn_type="rope",
                qk_norm=True,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=drop_path_rate,
                init_values=init_values,
                norm_layer=norm_layer,
                **dd,
            )
            for _ in range(check_int("depth", depth))
        )
        self.norm = norm_layer(embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes else nn.Identity()
        self.init_weights()

    def init_weights(self) -> None:
        """timm's ViT initialisation (truncated normal, std 0.02); the layer scales at ``init_values``."""
        for tensor in (self.cls_token, self.pos_embed, self.reg_token):
            if tensor is not None:
                trunc_normal_(tensor, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "reg_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return {"stem": r"^cls_token|reg_token|pos_embed|patch_embed", "blocks": [(r"^blocks\.(\d+)", None)]}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            if global_pool not in ("token", "avg"):
                raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
            self.global_pool = global_pool
        self.num_classes = check_int("num_classes", num_classes, 0)
        dd = {"device": self.cls_token.device, "dtype": self.cls_token.dtype}
        self.head = nn.Linear(self.embed_dim, num_classes, **dd) if num_classes else nn.Identity()

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token sequence [CLS, patches, registers] of images x (B, C, H, W), and its rope."""
        x = self.patch_embed(x)
        if self.dynamic_img_size:
            B, gh, gw, C = x.shape
            pos = resample_abs_pos_embed(self.pos_embed, (gh, gw), self.patch_embed.grid_size, num_prefix_tokens=0)
            x = x.reshape(B, gh * gw, C) + pos
        else:
            (gh, gw), x = self.patch_embed.grid_size, x + self.pos_embed
        parts = [self.cls_token.expand(x.shape[0], -1, -1), x]
        if self.reg_token is not None:
            parts.append(self.reg_token.expand(x.shape[0], -1, -1))
        return torch.cat(parts, dim=1), self.rope((gh, gw), x.device)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised tokens (B, 1 + patches + registers, C) of images x (B, C, H, W)."""
        x, rope = self._tokens(x)
        for block in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(block, x, rope=rope, use_reentrant=False)
            else:
                x = block(x, rope=rope)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "token":
            x = x[:, 0]
        else:
            x = x[:, self.num_prefix_tokens : x.shape[1] - self.num_suffix_tokens].mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A ViT-5 checkpoint of the authors' code for :class:`ViT5`: their RoPE frequency buffers
    (constants this model computes) are dropped; every other name is the same."""
    state_dict = state_dict.get("model", state_dict)
    return {k: v for k, v in state_dict.items() if not k.endswith((".rope.freqs", ".rope_reg.freqs"))}


MODEL_NAMES = [
    *(f"vit5_{size}" for size in ("small", "base")),
    *(f"mita_vit5_{size}{suffix}" for size in ("small", "base") for suffix in ("", "_dwc")),
]
PAPERS = {"mita": "arXiv:2602.01219", "vit5": "arXiv:2602.08071"}
default_cfgs = generate_default_cfgs(
    {
        # the ViT-5 recipe evaluates at crop ratio 1.0
        name: pretrained_cfg(crop_pct=1.0, paper_ids=PAPERS[name.split("_")[0]])
        for name in MODEL_NAMES
    }
)


def _create(variant: str, pretrained: bool = False, mita: bool = False, **kwargs: Any) -> ViT5:
    """A :class:`ViT5` of ``kwargs``, converted to MiTA (its options popped from kwargs) when ``mita``."""
    options = {k: kwargs.pop(k) for k in MITA_OPTIONS if k in kwargs}
    if options and not mita:
        raise ValueError(f"{variant} has standard attention and takes no MiTA options {sorted(options)}")
    model = build_model_with_cfg(ViT5, variant, pretrained=False, **kwargs)
    if mita:
        conversion.convert(model, "mita", **{"num_landmarks": 25, "topk": 30, **options})
    if pretrained:
        load_local_checkpoint(model, variant, checkpoint_filter_fn)
    return model


_SMALL = {"patch_size": 16, "embed_dim": 384, "depth": 12, "num_heads": 6}
_BASE = {"patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12}


@register_model
def vit5_small(pretrained: bool = False, **kwargs: Any) -> ViT5:
    """ViT-5-Small (arXiv 2602.08071), standard attention."""
    return _create("vit5_small", pretrained, **{**_SMALL, **kwargs})


@register_model
def vit5_base(pretrained: bool = False, **kwargs: Any) -> ViT5:
    """ViT-5-Base (arXiv 2602.08071), standard attention."""
    return _create("vit5_base", pretrained, **{**_BASE, **kwargs})


@register_model
def mita_vit5_small(pretrained: bool = False, **kwargs: Any) -> ViT5:
    """MiTA-ViT-5-Small: m = 25 landmarks from the patch queries, k = 30 (arXiv 2602.01219)."""
    return _create("mita_vit5_small", pretrained, mita=True, **{**_SMALL, **kwargs})


@register_model
def mita_vit5_small_dwc(pretrained: bool = False, **kwargs: Any) -> ViT5:
    """MiTA-ViT-5-Small with a depth-wise convolution on V."""
    return _create("mita_vit5_small_dwc", pretrained, mita=True, **{**_SMALL, "dwc": True, **kwargs})


@register_model
def mita_vit5_base(pretrained: bool = False, **kwargs: Any) -> ViT5:
    """MiTA-ViT-5-Base: m = 25 landmarks from the patch queries, k = 30 (arXiv 2602.01219)."""
    return _create("mita_vit5_base", pretrained, mita=True, **{**_BASE, **kwargs})


@register_model
def mita_vit5_base_dwc(pretrained: bool = False, **kwargs: Any) -> ViT5:
    """MiTA-ViT-5-Base with a depth-wise convolution on V."""
    return _create("mita_vit5_base_dwc", pretrained, mita=True, **{**_BASE, "dwc": True, **kwargs})
