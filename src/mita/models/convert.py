"""Any timm ViT with another attention: :func:`convert` swaps its ``Attention`` layers in place.

Parameter names stay timm's, so state dicts move between the converted and the original
model unchanged; :func:`revert` puts timm's own ``Attention`` back. Needs timm.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from timm.layers import Attention

from .. import attention as registry
from ..layers.base import AttentionLayer, PatchGrid
from ..layers.mita import MiTAVisionAttention

#: modules moved unchanged from the old attention layer to the new one (timm's ``Attention`` names)
_SHARED_CHILDREN = ("qkv", "q_norm", "k_norm", "norm", "gate", "proj", "attn_drop", "proj_drop")


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


def _vision_defaults(model: nn.Module, options: list[str], name: str) -> dict[str, Any]:
    """``num_prefix_tokens`` and ``grid`` from a timm ViT (or a video model whose ``patch_embed.grid_size``
    is (gt, gh, gw)), for layers that take them (``options``: the layer's options)."""
    found: dict[str, Any] = {}
    if "num_prefix_tokens" in options:
        found["num_prefix_tokens"] = int(getattr(model, "num_prefix_tokens", 0))
    grid_size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if "grid" in options and grid_size is not None:
        square = len(grid_size) == 2 and grid_size[0] == grid_size[1]
        found["grid"] = "auto" if square and name == "mita" else tuple(int(g) for g in grid_size)
    return found


def _new_layer(old: nn.Module, attention: registry.Config | str, options: dict[str, Any], model: nn.Module):
    dim, heads, kwargs = old.qkv.in_features, old.num_heads, _timm_kwargs(old)
    if attention == "timm":
        if options:
            raise ValueError(f"convert(attention='timm') takes no options, got {sorted(options)}")
        return Attention(dim, heads, **kwargs)
    name, config_options = registry.parse(attention)
    method = registry.get(name)
    valid = registry.layer_options(method, MiTAVisionAttention if name == "mita" else None)
    bad = sorted(set(config_options) - set(valid)) + sorted(set(options) - set(valid))
    if bad:
        raise ValueError(f"convert(): attention {name!r} takes no options {bad}; its options: {valid}")
    options = {**_vision_defaults(model, valid, name), **config_options, **options}
    if name == "mita":
        options = {**method.defaults, "num_landmarks": 25, "topk": 25, **options}
        return MiTAVisionAttention(dim, heads, **kwargs, **options)
    return registry.build_layer({"name": name, **options}, dim, heads, **kwargs)


class _RecordPatchGrid:
    """A forward pre-hook on a timm patch embedding: the patch grid of each image, into a :class:`PatchGrid`."""

    def __init__(self, patch_grid: PatchGrid) -> None:
        self.patch_grid = patch_grid

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.patch_grid.current = module.dynamic_feat_size(args[0].shape[-2:])


def _track_patch_grid(model: nn.Module, layers: list[nn.Module]) -> None:
    """Give ``layers`` the patch grid of each forward when the model takes images of any size.

    timm's ``dynamic_img_size`` (a patch embedding with ``strict_img_size=False``) lets the grid
    change per call; the grid read from the model at conversion would then pool a 256x144
    image (16x9 patches) as 12x12. A pre-hook on the patch embedding records each image's grid
    (``dynamic_feat_size``) and the layers pool on it. The hook is removed when no layer needs it.
    """
    embed = getattr(model, "patch_embed", None)
    if not isinstance(embed, nn.Module):
        return
    hooks = {key: hook for key, hook in embed._forward_pre_hooks.items() if isinstance(hook, _RecordPatchGrid)}
    users = [layer for layer in layers if hasattr(layer, "patch_grid")]
    dynamic = hasattr(embed, "dynamic_feat_size") and getattr(embed, "strict_img_size", True) is False
    if not (dynamic and users):
        for key in hooks:
            del embed._forward_pre_hooks[key]
        return
    if hooks:
        patch_grid = next(iter(hooks.values())).patch_grid
    else:
        patch_grid = PatchGrid()
        embed.register_forward_pre_hook(_RecordPatchGrid(patch_grid))
    for layer in users:
        layer.patch_grid = patch_grid


def _extra_parameters(layer: nn.Module) -> list[str]:
    return sorted(n for n, _ in layer.named_children() if n not in _SHARED_CHILDREN and getattr(layer, n) is not None)


def convert(model: nn.Module, attention: registry.Config = "mita", **options: Any) -> nn.Module:
    """Swap every attention layer of a timm ViT for ``attention`` in place, keeping its weights.

    ``attention`` is any registered method or config (``"mita"``, ``"sdpa"``,
    ``"mita:topk=49"``) or ``"timm"`` for timm's own ``Attention`` (the way back). The
    ``qkv``/``proj``/norm modules are moved into the new layers, so parameters keep their
    identity and names and the state dict round-trips exactly. For MiTA, ``num_prefix_tokens``
    and the patch ``grid`` are read from the model (a model with ``dynamic_img_size`` pools each
    image on its own patch grid), and m = k = 25 unless given; ``dwc=True``
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
    _track_patch_grid(model, [new for _, _, new in swaps])
    return model


def revert(model: nn.Module) -> nn.Module:
    """Put timm's own ``Attention`` back in every layer: ``convert(model, "timm")``."""
    return convert(model, "timm")
