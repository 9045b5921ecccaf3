"""Any timm ViT with another attention: :func:`convert` swaps its attention layers in place.

It takes timm's ``Attention`` (ViT, DeiT, ...), ``AttentionRope`` and ``EvaAttention`` (EVA-02, the
RoPE ViTs, PE, DINOv3, ... and this library's ViT-5), which receive ``rope=`` from their model at
every block: the new layers keep their projection layout and apply the rotary embedding as they
do. Parameter names stay timm's, so state dicts move between the converted and the original
model unchanged; :func:`revert` puts timm's own class back. Other attention modules are refused
by class name. Needs timm.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from timm.layers import Attention, AttentionRope
from timm.models.eva import EvaAttention

from .. import attention as registry
from ..layers.base import AttentionLayer, PatchGrid
from ..layers.mita import MiTAVisionAttention

#: timm's attention classes :func:`convert` replaces (by exact class: a subclass may change the forward)
TIMM_CLASSES = (Attention, AttentionRope, EvaAttention)
#: modules and parameters moved unchanged from the old attention layer to the new one (timm's names)
_SHARED_CHILDREN = (
    "qkv",
    "q_proj",
    "k_proj",
    "v_proj",
    "q_norm",
    "k_norm",
    "norm",
    "gate",
    "proj",
    "attn_drop",
    "proj_drop",
)
_SHARED_PARAMETERS = ("q_bias", "v_bias")


def _layout(layer: nn.Module, model: nn.Module) -> dict[str, Any]:
    """The constructor arguments of an attention layer (timm's or this library's), read from its modules.

    The prefix (and suffix) counts are the layer's own where it has them (timm's RoPE layers leave
    their prefix unrotated), else the model's (``num_prefix_tokens``, and ``num_suffix_tokens`` of
    a model with tokens after the patches).
    """
    fused = getattr(layer, "qkv", None) is not None
    first = layer.qkv if fused else layer.q_proj
    eva_bias = getattr(layer, "q_bias", None) is not None  # EVA: q and v biases beside a bias-free qkv
    qkv_bias = eva_bias or first.bias is not None
    return {
        "attn_head_dim": layer.head_dim,
        "dim_out": layer.proj.out_features,
        "qkv_bias": qkv_bias,
        "proj_bias": layer.proj.bias is not None,
        "gated": getattr(layer, "gate", None) is not None,
        "attn_drop": layer.attn_drop.p,
        "proj_drop": layer.proj_drop.p,
        "qkv_fused": fused,
        "num_kv_heads": getattr(layer, "num_kv_heads", None) or layer.num_heads,
        "key_bias": not qkv_bias or (not eva_bias and (fused or layer.k_proj.bias is not None)),
        "rotate_half": bool(getattr(layer, "rotate_half", False)),
        "num_prefix_tokens": int(getattr(layer, "num_prefix_tokens", getattr(model, "num_prefix_tokens", 0))),
        "num_suffix_tokens": int(getattr(layer, "num_suffix_tokens", getattr(model, "num_suffix_tokens", 0))),
    }


def _timm_class(layer: nn.Module, layout: dict[str, Any]) -> type[nn.Module]:
    """The timm class a layer goes back to: the one it was converted from, else the first whose layout it has."""
    recorded = getattr(layer, "timm_class", None)
    if recorded is not None:
        return recorded
    plain = layout["qkv_fused"] and layout["key_bias"] and not layout["rotate_half"]
    if plain and layout["num_kv_heads"] == layer.num_heads:
        return Attention
    return AttentionRope if layout["key_bias"] else EvaAttention


def _timm_layer(cls: type[nn.Module], dim: int, heads: int, layout: dict[str, Any]) -> nn.Module:
    """A timm attention layer of ``cls`` with ``layout`` (its norms are moved in afterwards)."""
    common = {k: layout[k] for k in ("attn_head_dim", "qkv_bias", "gated", "attn_drop", "proj_drop")}
    if cls is Attention:
        if not layout["key_bias"] or not layout["qkv_fused"] or layout["num_kv_heads"] != heads:
            raise ValueError(
                "timm's Attention has one qkv projection with one bias for q, k and v; this layer's layout "
                f"(qkv_fused={layout['qkv_fused']}, key_bias={layout['key_bias']}, num_kv_heads="
                f"{layout['num_kv_heads']}) is AttentionRope's or EvaAttention's"
            )
        return Attention(dim, heads, dim_out=layout["dim_out"], proj_bias=layout["proj_bias"], **common)
    rope = {k: layout[k] for k in ("qkv_fused", "num_prefix_tokens", "rotate_half")}
    if cls is AttentionRope:
        if not layout["key_bias"]:
            raise ValueError("timm's AttentionRope has a key bias wherever it has a q bias; this layer has none")
        extra = {"dim_out": layout["dim_out"], "proj_bias": layout["proj_bias"], "num_kv_heads": layout["num_kv_heads"]}
        return AttentionRope(dim, heads, **common, **rope, **extra)
    if (layout["key_bias"] and layout["qkv_bias"]) or layout["num_kv_heads"] != heads:
        raise ValueError("timm's EvaAttention has no key bias and no grouped key/value heads; this layer has one")
    return EvaAttention(dim, heads, scale_norm=False, **common, **rope)


def _vision_defaults(model: nn.Module, options: list[str], name: str) -> dict[str, Any]:
    """The patch ``grid`` of a timm ViT (or of a video model whose ``patch_embed.grid_size`` is
    (gt, gh, gw)), for layers that take one (``options``: the layer's options)."""
    grid_size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if "grid" not in options or grid_size is None:
        return {}
    square = len(grid_size) == 2 and grid_size[0] == grid_size[1]
    return {"grid": "auto" if square and name == "mita" else tuple(int(g) for g in grid_size)}


def _new_layer(old: nn.Module, attention: registry.Config | str, options: dict[str, Any], model: nn.Module):
    heads, layout = old.num_heads, _layout(old, model)
    dim = (old.qkv if getattr(old, "qkv", None) is not None else old.q_proj).in_features
    if attention == "timm":
        if options:
            raise ValueError(f"convert(attention='timm') takes no options, got {sorted(options)}")
        layer = _timm_layer(_timm_class(old, layout), dim, heads, layout)
        if isinstance(layer, EvaAttention):  # how its bias is added: a flag of timm's, no layout of weights
            layer.qkv_bias_separate = getattr(old, "timm_qkv_bias_separate", False)
        return layer
    name, config_options = registry.parse(attention)
    method = registry.get(name)
    valid = registry.layer_options(method, MiTAVisionAttention if name == "mita" else None)
    bad = sorted(set(config_options) - set(valid)) + sorted(set(options) - set(valid))
    if bad:
        raise ValueError(f"convert(): attention {name!r} takes no options {bad}; its options: {valid}")
    options = {**_vision_defaults(model, valid, name), **config_options, **options}
    layout = {k: v for k, v in layout.items() if k not in options}
    if name == "mita":
        defaults = {**method.defaults, "num_landmarks": 25, "topk": 25}
        layer = MiTAVisionAttention(dim, heads, **layout, **{**defaults, **options})
    else:
        layer = registry.build_layer({"name": name, **options}, dim, heads, **layout)
    layer.timm_class = type(old) if type(old) in TIMM_CLASSES else getattr(old, "timm_class", None)
    layer.timm_qkv_bias_separate = getattr(old, "qkv_bias_separate", getattr(old, "timm_qkv_bias_separate", False))
    return layer


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


def _unknown_attention(module: nn.Module) -> bool:
    """An attention module convert does not take: named ``...Attention`` (or torch's), not one it converts."""
    if type(module) in TIMM_CLASSES or isinstance(module, AttentionLayer):
        return False
    return isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention")


def _refuse_unknown_attention(model: nn.Module) -> None:
    """Refuse a model with attention modules convert cannot reproduce, naming their classes."""
    unknown: dict[str, str] = {}
    for path, module in model.named_modules():
        if _unknown_attention(module):
            unknown.setdefault(f"{type(module).__module__}.{type(module).__qualname__}", path or "the model")
    if unknown:
        found = ", ".join(f"{cls} (at {path})" for cls, path in unknown.items())
        raise ValueError(
            f"convert cannot take {found}: it replaces timm's Attention, AttentionRope and EvaAttention (exactly "
            "those classes, whose forward it reproduces) and this library's layers; other attention modules "
            "(relative position biases, windows, a subclass with its own forward, Hugging Face's: use "
            "attn_implementation='mita') are not converted"
        )


def convert(model: nn.Module, attention: registry.Config = "mita", **options: Any) -> nn.Module:
    """Swap every attention layer of a timm ViT for ``attention`` in place, keeping its weights.

    ``attention`` is any registered method or config (``"mita"``, ``"sdpa"``,
    ``"mita:topk=49"``) or ``"timm"`` for timm's own class (the way back: the class each layer
    was converted from). The layers taken are timm's ``Attention``, ``AttentionRope`` and
    ``EvaAttention`` (their projection layouts, biases, grouped key/value heads and rotary pairing
    are kept; ``rope=`` from the model is applied to q and k before the attention, so MiTA pools
    rotated queries) and this library's layers; a model with any other attention module is
    refused, naming its class. The projection and norm modules are moved into the new layers,
    so parameters keep their identity and names and the state dict round-trips exactly. For
    MiTA, ``num_prefix_tokens`` (and a ``num_suffix_tokens`` the model declares) and the patch
    ``grid`` are read from the model (a model with ``dynamic_img_size`` pools each image on its
    own patch grid), and m = k = 25 unless given; ``dwc=True`` and ``out_gate=True`` add the
    MiTA-DeiT extras (new parameters). Returns ``model`` (or the new layer when ``model`` itself
    is an attention layer).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a timm ViT), got {type(model).__name__}")
    if not isinstance(attention, (str, dict)):
        raise TypeError(f"attention must be a method name, a config string or dict, or 'timm'; got {attention!r}")
    _refuse_unknown_attention(model)
    targets = [(n, m) for n, m in model.named_modules() if type(m) in TIMM_CLASSES or isinstance(m, AttentionLayer)]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no timm Attention, AttentionRope or EvaAttention (or mita AttentionLayer) "
            "modules to convert; convert works on timm ViTs (VisionTransformer, DeiT, Eva, ...)"
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
        for child in (*_SHARED_CHILDREN, *_SHARED_PARAMETERS, *_extra_parameters(old)):
            if getattr(old, child, None) is not None:
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
