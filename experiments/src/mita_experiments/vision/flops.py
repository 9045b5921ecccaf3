"""FLOP and parameter tables of ViTs with full attention and with MiTA (``mita vision flops``).

How the numbers are made (all in FLOPs = 2 x multiply-accumulates, batch 1):

* The whole full-attention model is counted by ``torch.utils.flop_counter.FlopCounterMode`` on
  the meta device (no memory, no arithmetic): patch embedding, qkv, proj, MLP, head and the
  attention matmuls (SDPA decomposes to two bmm's there, 4 N^2 D per head).
* The dense part is that total minus the attention matmuls; MiTA leaves it unchanged.
* MiTA's attention per head and layer is the spec's formula N D (8m + 4sk) (``mita.attention.flops``)
  plus its selection work, counted explicitly as one op per element: top-k over the m x N
  affinities (m N log2 k comparisons), routing over the N x m gate (N m comparisons per
  routed expert) and the gather of the m k selected keys and values (2 m k D copies).
* "counted" is FlopCounterMode on this library's own MiTA implementation (the PyTorch
  ``impl="grouped"`` path on random tensors; the fused CPU kernel is opaque to the counter),
  plus the same selection work: what the code spends, not the ideal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from mita import attention as registry
from mita.ops.mita import mita_attention

PAPER_CLAIM = "up to 42% fewer FLOPs than the full-attention backbone (ADE20K, Segmenter, 512x512)"


@dataclass(frozen=True)
class Backbone:
    """A ViT with 16 px patches and a CLS token, and the MiTA m = k it runs with."""

    name: str
    embed_dim: int
    depth: int
    num_heads: int
    img_size: int
    m: int
    num_classes: int = 1000

    @property
    def tokens(self) -> int:
        return (self.img_size // 16) ** 2 + 1

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


TABLE_BACKBONES = [
    Backbone("DeiT-T", 192, 12, 3, 224, 25),
    Backbone("DeiT-S", 384, 12, 6, 224, 25),
    Backbone("DeiT-B", 768, 12, 12, 224, 25),
    Backbone("ViT-T backbone", 192, 12, 3, 512, 49, num_classes=0),
    Backbone("ViT-S backbone", 384, 12, 6, 512, 49, num_classes=0),
    Backbone("ViT-B backbone", 768, 12, 12, 512, 49, num_classes=0),
]
SWEEP_SIZES = (224, 384, 512, 768, 1024)


def selection_ops(n: int, d: int, m: int, k: int, s: int = 1) -> float:
    """MiTA's non-matmul work per head: top-k (m N log2 k), routing (s N m), gather (2 m k D)."""
    k = min(k, n)
    return m * n * math.log2(max(k, 2)) + s * n * m + 2 * m * k * d


def mita_formula_flops(n: int, d: int, m: int, k: int, s: int = 1) -> float:
    """Spec section 3 (via the registry) plus :func:`selection_ops`, per head."""
    return registry.flops({"name": "mita", "num_landmarks": m, "topk": k, "num_routed": s}, n, d) + selection_ops(
        n, d, m, k, s
    )


def mita_counted_flops(
    n: int,
    d: int,
    heads: int,
    m: int | tuple[int, ...],
    k: int,
    grid: tuple[int, ...] | None = None,
    num_prefix_tokens: int = 1,
    num_suffix_tokens: int = 0,
) -> float:
    """FlopCounterMode on :func:`mita_attention` (B=1), per head: on ``grid`` between ``num_prefix_tokens``
    and ``num_suffix_tokens`` tokens (default: a square grid after one CLS token)."""
    grid = grid or (math.isqrt(n - num_prefix_tokens - num_suffix_tokens),) * 2
    q, kk, v = torch.randn(3, 1, heads, n, d).unbind(0)
    ends = {"num_prefix_tokens": num_prefix_tokens, "num_suffix_tokens": num_suffix_tokens}
    with FlopCounterMode(display=False) as counter:
        mita_attention(q, kk, v, num_landmarks=m, topk=k, grid=grid, **ends, impl="grouped")
    landmarks = m if isinstance(m, int) else math.prod(m)
    return counter.get_total_flops() / heads + selection_ops(n, d, landmarks, k)


def full_model_flops(b: Backbone) -> tuple[float, float, int]:
    """(total FLOPs, attention-matmul FLOPs, parameters) of the full-attention timm ViT, on meta."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        img_size=b.img_size,
        patch_size=16,
        embed_dim=b.embed_dim,
        depth=b.depth,
        num_heads=b.num_heads,
        num_classes=b.num_classes,
        device="meta",
    )
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, b.img_size, b.img_size, device="meta"))
    attn = b.depth * b.num_heads * registry.flops("sdpa", b.tokens, b.head_dim)
    return float(counter.get_total_flops()), attn, sum(p.numel() for p in model.parameters())


def extras_params(b: Backbone) -> int:
    """Parameters the _dwc_gate extras add: 3x3 depth-wise conv (10 C) and the gate (C^2 + C) per layer."""
    c = b.embed_dim
    return b.depth * (10 * c + c * c + c)


def backbone_row(b: Backbone, counted: bool = True) -> dict[str, float | int | str]:
    """One table row: parameters, full and MiTA GFLOPs, and the reduction."""
    total, attn, params = full_model_flops(b)
    dense = total - attn
    per_layer = b.depth * b.num_heads
    mita = dense + per_layer * mita_formula_flops(b.tokens, b.head_dim, b.m, b.m)
    row: dict[str, float | int | str] = {
        "model": b.name,
        "image": f"{b.img_size}x{b.img_size}",
        "N": b.tokens,
        "m = k": b.m,
        "params (M)": params / 1e6,
        "params +DWC+gate (M)": (params + extras_params(b)) / 1e6,
        "full GFLOPs": total / 1e9,
        "attention share (%)": 100 * attn / total,
        "MiTA GFLOPs": mita / 1e9,
        "reduction (%)": 100 * (1 - mita / total),
    }
    if counted:
        impl = dense + per_layer * mita_counted_flops(b.tokens, b.head_dim, b.num_heads, b.m, b.m)
        row["MiTA GFLOPs (counted impl)"] = impl / 1e9
        row["reduction, counted (%)"] = 100 * (1 - impl / total)
    return row


def length_sweep(sizes: tuple[int, ...] | None = None, m: int = 49) -> list[dict[str, float | int | str]]:
    """ViT-S backbone FLOPs against image size (default :data:`SWEEP_SIZES`), m = k fixed."""
    return [
        backbone_row(Backbone("ViT-S backbone", 384, 12, 6, s, m, num_classes=0), counted=False)
        for s in sizes or SWEEP_SIZES
    ]


#: ViT-5-S's image sizes and the MiTA authors' MiTA-ViT-5 setting (m = 25 landmarks from the patches, k = 30)
VIT5_SIZES = (224, 384, 512)


def vit5_rows(sizes: tuple[int, ...] = VIT5_SIZES, m: int = 25, k: int = 30) -> list[dict[str, float | int | str]]:
    """ViT-5-S (``vit5_small``: CLS, patches, 4 registers; RoPE) against MiTA-ViT-5-S, per image size.

    As :func:`backbone_row`: the dense model counted on meta, its attention matmuls replaced by
    MiTA's formula plus selection work (N counts the CLS token and the registers, which take part
    as queries and keys), and by the counted implementation (landmarks from the patches only).
    """
    import timm

    rows: list[dict[str, float | int | str]] = []
    for size in sizes:
        model = timm.create_model("vit5_small", pretrained=False, img_size=size, device="meta")
        with FlopCounterMode(display=False) as counter:
            model(torch.empty(1, 3, size, size, device="meta"))
        total, side = float(counter.get_total_flops()), size // 16
        n, heads, depth = side * side + 5, model.blocks[0].attn.num_heads, len(model.blocks)
        d = model.embed_dim // heads
        attn = depth * heads * registry.flops("sdpa", n, d)
        mita = total - attn + depth * heads * mita_formula_flops(n, d, m, k)
        counted = total - attn + depth * heads * mita_counted_flops(n, d, heads, m, k, num_suffix_tokens=4)
        rows.append(
            {
                "model": "ViT-5-S",
                "image": f"{size}x{size}",
                "N": n,
                "m, k": f"{m}, {k}",
                "params (M)": sum(p.numel() for p in model.parameters()) / 1e6,
                "full GFLOPs": total / 1e9,
                "attention share (%)": 100 * attn / total,
                "MiTA GFLOPs": mita / 1e9,
                "reduction (%)": 100 * (1 - mita / total),
                "MiTA GFLOPs (counted impl)": counted / 1e9,
                "reduction, counted (%)": 100 * (1 - counted / total),
            }
        )
    return rows


def method_flops_per_head(lengths: list[int], d: int = 64) -> dict[str, list[float]]:
    """Attention FLOPs per head of every registered method with a cost model (registry defaults)."""
    return {
        method.name: [float(registry.flops(method.name, n, d)) for n in lengths]
        for method in registry.methods()
        if method.flops is not None
    }


def markdown_table(rows: list[dict[str, float | int | str]]) -> str:
    """Rows of equal keys as a markdown table (floats to 2 decimals)."""
    keys = list(rows[0])
    cell = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join([*lines, *("| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows)]) + "\n"
