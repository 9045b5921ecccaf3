"""MiTA-DeiT models in timm's registry (the authors' models: m = k = 25 at 224 px).

``mita_deit_{tiny,small,base}_patch16_224`` and their ``_dwc`` (a depth-wise convolution on
V) and ``_dwc_gate`` (plus a SiLU output gate) variants, registered with ``@register_model``
when this module is imported (``import mita`` arranges that as soon as timm is imported), so
``timm.create_model`` and scripts built on it find them. Any MiTA option can be passed to
``create_model`` (``num_landmarks=49, topk=49, compat="official"``); the rest goes to timm's
``VisionTransformer``. The models are timm ViTs whose attention :func:`~mita.models.convert.convert`
swapped, so the authors' checkpoints (timm DeiT layout, plus ``dwc`` and a fused ``qkvg``
projection for the gated model) load as they are.
"""

from __future__ import annotations

from typing import Any

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer

from . import convert as conversion  # the module, not its function: convert.py imports timm, which imports this
from .weights import load_local_checkpoint, pretrained_cfg

#: MiTA options a model entry point accepts (the rest goes to ``VisionTransformer``)
MITA_OPTIONS = ("num_landmarks", "topk", "num_routed", "compat", "branches", "impl", "dwc", "out_gate")


MODEL_NAMES = [
    f"mita_deit_{size}_patch16_224{suffix}"
    for size in ("tiny", "small", "base")
    for suffix in ("", "_dwc", "_dwc_gate")
]
default_cfgs = generate_default_cfgs({name: pretrained_cfg(paper_ids="arXiv:2602.01219") for name in MODEL_NAMES})


def _create(variant: str, pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """A timm DeiT ``VisionTransformer`` of ``kwargs`` with MiTA attention (the MiTA options popped from kwargs)."""
    mita_options = {k: kwargs.pop(k) for k in MITA_OPTIONS if k in kwargs}
    model = build_model_with_cfg(VisionTransformer, variant, pretrained=False, **kwargs)
    conversion.convert(model, "mita", **mita_options)
    if pretrained:
        load_local_checkpoint(model, variant)
    return model


_TINY = {"patch_size": 16, "embed_dim": 192, "depth": 12, "num_heads": 3}
_SMALL = {"patch_size": 16, "embed_dim": 384, "depth": 12, "num_heads": 6}
_BASE = {"patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12}
_DWC = {"dwc": True}
_DWC_GATE = {"dwc": True, "out_gate": True}


@register_model
def mita_deit_tiny_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Tiny, m = k = 25 at 224 px (arXiv 2602.01219)."""
    return _create("mita_deit_tiny_patch16_224", pretrained, **{**_TINY, **kwargs})


@register_model
def mita_deit_tiny_patch16_224_dwc(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Tiny with a depth-wise convolution on V."""
    return _create("mita_deit_tiny_patch16_224_dwc", pretrained, **{**_TINY, **_DWC, **kwargs})


@register_model
def mita_deit_tiny_patch16_224_dwc_gate(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Tiny with a depth-wise convolution on V and a SiLU output gate."""
    return _create("mita_deit_tiny_patch16_224_dwc_gate", pretrained, **{**_TINY, **_DWC_GATE, **kwargs})


@register_model
def mita_deit_small_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Small, m = k = 25 at 224 px (arXiv 2602.01219)."""
    return _create("mita_deit_small_patch16_224", pretrained, **{**_SMALL, **kwargs})


@register_model
def mita_deit_small_patch16_224_dwc(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Small with a depth-wise convolution on V."""
    return _create("mita_deit_small_patch16_224_dwc", pretrained, **{**_SMALL, **_DWC, **kwargs})


@register_model
def mita_deit_small_patch16_224_dwc_gate(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Small with a depth-wise convolution on V and a SiLU output gate."""
    return _create("mita_deit_small_patch16_224_dwc_gate", pretrained, **{**_SMALL, **_DWC_GATE, **kwargs})


@register_model
def mita_deit_base_patch16_224(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Base, m = k = 25 at 224 px (arXiv 2602.01219)."""
    return _create("mita_deit_base_patch16_224", pretrained, **{**_BASE, **kwargs})


@register_model
def mita_deit_base_patch16_224_dwc(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Base with a depth-wise convolution on V."""
    return _create("mita_deit_base_patch16_224_dwc", pretrained, **{**_BASE, **_DWC, **kwargs})


@register_model
def mita_deit_base_patch16_224_dwc_gate(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """MiTA-DeiT-Base with a depth-wise convolution on V and a SiLU output gate."""
    return _create("mita_deit_base_patch16_224_dwc_gate", pretrained, **{**_BASE, **_DWC_GATE, **kwargs})


def register_models() -> list[str]:
    """The MiTA-DeiT names (registered with timm when this module was imported)."""
    return MODEL_NAMES
