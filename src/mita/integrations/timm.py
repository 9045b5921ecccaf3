"""timm integration: MiTA-DeiT models in timm's registry, and :func:`convert` for any timm ViT.

Importing this module (``import mita`` does so as soon as timm is imported) registers
``mita_deit_{tiny,small,base}_patch16_224`` and their ``_dwc`` and ``_dwc_gate`` variants (the
authors' MiTA-DeiT models, m = k = 25 at 224 px), so ``timm.create_model`` and scripts built on
it find them. Any MiTA option can be passed to ``create_model`` (``num_landmarks=49, topk=49,
compat="official"``).

The models are timm ``VisionTransformer``s whose ``Attention`` modules are swapped by
:func:`convert`; parameter names stay timm's, so the authors' checkpoints (timm DeiT layout,
plus ``dwc`` and a fused ``qkvg`` projection for the gated model) load as they are.
"""

from __future__ import annotations

import inspect
from typing import Any

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention
from timm.models import build_model_with_cfg, generate_default_cfgs, load_pretrained, register_model
from timm.models.vision_transformer import VisionTransformer

from .. import attention as registry
from ..layers.base import AttentionLayer
from ..layers.mita import MiTAAttention

#: modules moved unchanged from the old attention layer to the new one (timm's ``Attention`` names)
_SHARED_CHILDREN = ("qkv", "q_norm", "k_norm", "norm", "gate", "proj", "attn_drop", "proj_drop")
#: options of :class:`MiTAVisionAttention` beyond :class:`MiTAAttention`'s
_VISION_OPTIONS = ("dwc", "out_gate")
#: MiTA options a model entry point accepts (the rest goes to ``VisionTransformer``)
MITA_OPTIONS = ("num_landmarks", "topk", "num_routed", "compat", "branches", "impl", *_VISION_OPTIONS)


class MiTAVisionAttention(MiTAAttention):
    """:class:`MiTAAttention` with the two extras of the authors' MiTA-DeiT models.

    ``dwc``: a 3x3 depth-wise convolution of V over the patch grid, added to the attention
    output (zero on the prefix tokens); it restores the locality that sparse routing loses.
    ``out_gate``: ``SiLU(x W_g)`` multiplied into the attention output before ``proj``.
    The authors' gated checkpoints fuse ``qkv`` and ``W_g`` into one ``qkvg`` projection;
    such a state dict is split on load.
    """

    def __init__(self, dim: int, num_heads: int = 8, *args: Any, dwc: bool = False, out_gate: bool = False, **kwargs):
        super().__init__(dim, num_heads, *args, **kwargs)
        if dwc and self.grid is None:
            raise ValueError("dwc=True needs a patch grid: pass grid='auto' or grid=(gh, gw)")
        dd = {"device": self.qkv.weight.device, "dtype": self.qkv.weight.dtype}
        c = self.attn_dim
        self.dwc = nn.Conv2d(c, c, 3, padding=1, groups=c, **dd) if dwc else None
        self.out_gate = nn.Linear(dim, c, bias=self.qkv.bias is not None, **dd) if out_gate else None
        if self.out_gate is not None:  # timm's ViT init for linear layers
            nn.init.trunc_normal_(self.out_gate.weight, std=0.02)
            if self.out_gate.bias is not None:
                nn.init.zeros_(self.out_gate.bias)
        self._gate_value: torch.Tensor | None = None  # SiLU(x W_g) of the running forward

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        self._gate_value = F.silu(self.out_gate(x)) if self.out_gate is not None else None
        try:
            return super().forward(x, attn_mask, is_causal)
        finally:
            self._gate_value = None

    def attend(self, q, k, v, key_padding_mask, is_causal):
        out = super().attend(q, k, v, key_padding_mask, is_causal)
        B, H, N, D = v.shape
        if self.dwc is not None:
            gh, gw = self.resolve_grid(N)
            p = N - gh * gw
            grid = v[:, :, p:].permute(0, 1, 3, 2).reshape(B, H * D, gh, gw)
            local = self.dwc(grid).reshape(B, H, D, gh * gw).transpose(-1, -2)
            out = out + F.pad(local, (0, 0, p, 0))
        if self._gate_value is not None:
            out = out * self._gate_value.reshape(B, N, H, D).transpose(1, 2)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Split the authors' fused ``qkvg`` projection into ``qkv`` and ``out_gate``."""
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}qkvg.{kind}", None)
            if fused is not None:
                c3 = fused.shape[0] // 4 * 3
                state_dict[f"{prefix}qkv.{kind}"], state_dict[f"{prefix}out_gate.{kind}"] = fused[:c3], fused[c3:]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _timm_kwargs(layer: nn.Module) -> dict[str, Any]:
    """The constructor arguments of an existing timm-style attention layer, read from its modules."""
    return {
        "attn_head_dim": layer.head_dim,
        "dim_out": layer.proj.out_features,
        "qkv_bias": layer.qkv.bias is not None,
        "proj_bias": layer.proj.bias is not None,
        "gated": getattr(layer, "gate", None) is not None,
        "attn_drop": layer.attn_drop.p,
        "proj_drop": layer.proj_drop.p,
    }


def _vision_defaults(model: nn.Module, method: registry.Method) -> dict[str, Any]:
    """``num_prefix_tokens`` and ``grid`` from a timm ViT, for methods whose op takes them."""
    accepts = inspect.signature(method.op).parameters
    found: dict[str, Any] = {}
    if "num_prefix_tokens" in accepts:
        found["num_prefix_tokens"] = int(getattr(model, "num_prefix_tokens", 0))
    grid_size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if "grid" in accepts and grid_size is not None:
        gh, gw = grid_size
        found["grid"] = "auto" if gh == gw and method.name == "mita" else (int(gh), int(gw))
    return found


def _new_layer(old: nn.Module, attention: registry.Config | str, options: dict[str, Any], model: nn.Module):
    dim, heads, kwargs = old.qkv.in_features, old.num_heads, _timm_kwargs(old)
    if attention == "timm":
        if options:
            raise ValueError(f"convert(attention='timm') takes no options, got {sorted(options)}")
        return Attention(dim, heads, **kwargs)
    name, config_options = registry.parse(attention)
    method = registry.get(name)
    options = {**_vision_defaults(model, method), **config_options, **options}
    if name == "mita":
        options = {**method.defaults, "num_landmarks": 25, "topk": 25, **options}
        return MiTAVisionAttention(dim, heads, **kwargs, **options)
    valid = set(inspect.signature(method.op).parameters)
    if method.layer is not None:
        valid |= set(inspect.signature(method.layer.__init__).parameters)
    bad = sorted(set(options) - valid)
    if bad:
        raise ValueError(f"attention {name!r} takes no options {bad}; its options: {sorted(valid - {'q', 'k', 'v'})}")
    return registry.build_layer({"name": name, **options}, dim, heads, **kwargs)


def _extra_parameters(layer: nn.Module) -> list[str]:
    return sorted(n for n, _ in layer.named_children() if n not in _SHARED_CHILDREN and getattr(layer, n) is not None)


def convert(model: nn.Module, attention: registry.Config = "mita", **options: Any) -> nn.Module:
    """Swap every attention layer of a timm ViT for ``attention`` in place, keeping its weights.

    ``attention`` is any registered method or config (``"mita"``, ``"sdpa"``,
    ``"mita:topk=49"``) or ``"timm"`` for timm's own ``Attention`` (the way back). The
    ``qkv``/``proj``/norm modules are moved into the new layers, so parameters keep their
    identity and names and the state dict round-trips exactly. For MiTA, ``num_prefix_tokens``
    and the patch ``grid`` are read from the model, and m = k = 25 unless given; ``dwc=True``
    and ``out_gate=True`` add the MiTA-DeiT extras (new parameters). Returns ``model`` (or
    the new layer when ``model`` itself is an attention layer).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a timm ViT), got {type(model).__name__}")
    if not isinstance(attention, (str, dict)):
        raise TypeError(f"attention must be a method name, a config string or dict, or 'timm'; got {attention!r}")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, (Attention, AttentionLayer))]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no timm Attention (or mita AttentionLayer) modules to convert; "
            "convert works on timm ViTs (VisionTransformer, DeiT, ...)"
        )
    swaps = []
    for name, old in targets:  # build and check every layer before touching the model
        new = _new_layer(old, attention, dict(options), model)
        dropped = sorted(set(_extra_parameters(old)) - set(_extra_parameters(new)))
        if dropped:
            raise ValueError(
                f"converting {name or 'the model'} to {attention!r} would drop its modules {dropped}; "
                "convert to a MiTA config with the same extras (dwc=True / out_gate=True)"
            )
        swaps.append((name, old, new))
    for name, old, new in swaps:
        for child in (*_SHARED_CHILDREN, *_extra_parameters(old)):
            setattr(new, child, getattr(old, child))
        new.train(old.training)
        if not name:
            return new
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model


def revert(model: nn.Module) -> nn.Module:
    """Put timm's own ``Attention`` back in every layer: ``convert(model, "timm")``."""
    return convert(model, "timm")


# --- the MiTA-DeiT model registry --------------------------------------------------------

_DEIT_SIZES = {
    "tiny": {"embed_dim": 192, "depth": 12, "num_heads": 3},
    "small": {"embed_dim": 384, "depth": 12, "num_heads": 6},
    "base": {"embed_dim": 768, "depth": 12, "num_heads": 12},
}
_VARIANTS = {"": {}, "_dwc": {"dwc": True}, "_dwc_gate": {"dwc": True, "out_gate": True}}
MODEL_NAMES = [f"mita_deit_{size}_patch16_224{suffix}" for size in _DEIT_SIZES for suffix in _VARIANTS]

default_cfgs = generate_default_cfgs(
    {
        name: {
            "url": "",
            "num_classes": 1000,
            "input_size": (3, 224, 224),
            "pool_size": None,
            "crop_pct": 0.875,
            "interpolation": "bicubic",
            "fixed_input_size": True,
            "mean": (0.485, 0.456, 0.406),
            "std": (0.229, 0.224, 0.225),
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "paper_ids": "arXiv:2602.01219",
        }
        for name in MODEL_NAMES
    }
)


def _entrypoint(name: str, size: str, variant: dict[str, bool]):
    def create(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        mita_options = {k: kwargs.pop(k) for k in MITA_OPTIONS if k in kwargs}
        model = build_model_with_cfg(
            VisionTransformer, name, pretrained=False, **{"patch_size": 16, **_DEIT_SIZES[size], **kwargs}
        )
        convert(model, "mita", **{**variant, **mita_options})
        if pretrained:
            cfg = model.pretrained_cfg
            if not (cfg.get("file") or cfg.get("state_dict")):
                raise ValueError(
                    f"{name} has no downloadable weights; pass pretrained_cfg_overlay=dict(file='checkpoint.pth') "
                    "with the authors' checkpoint, or load it with model.load_state_dict"
                )
            load_pretrained(model, pretrained_cfg=cfg, num_classes=model.num_classes)
        return model

    create.__name__ = create.__qualname__ = name
    create.__module__ = __name__
    create.__doc__ = f"MiTA-DeiT-{size.capitalize()} ({variant or 'plain'}), m = k = 25 at 224 px (arXiv 2602.01219)."
    return create


def register_models() -> list[str]:
    """Register the MiTA-DeiT names with timm (once); returns the names."""
    for size in _DEIT_SIZES:
        for suffix, variant in _VARIANTS.items():
            name = f"mita_deit_{size}_patch16_224{suffix}"
            if not timm.is_model(name):
                register_model(_entrypoint(name, size, variant))
    return MODEL_NAMES


register_models()
