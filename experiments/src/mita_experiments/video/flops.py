"""FLOPs of Hugging Face VideoMAE encoders with full attention and with MiTA (``mita video flops``).

Counted as ``mita vision flops`` counts ViTs (:mod:`mita_experiments.vision.flops`; FLOPs = 2 x MACs, batch 1):
the whole full-attention model by ``torch.utils.flop_counter.FlopCounterMode`` on the meta device,
its attention matmuls (4 N^2 D per head and layer) replaced by MiTA's formula plus its selection
work, and by FlopCounterMode on this library's grouped MiTA path ("counted impl").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from mita import attention as registry

from ..vision.flops import mita_counted_flops, mita_formula_flops

LANDMARKS = (2, 7, 7)
TOPK = 98


@dataclass(frozen=True)
class VideoBackbone:
    """A VideoMAE encoder: 16 px patches, tubelets of 2 frames, no CLS token."""

    name: str
    hidden_size: int
    depth: int
    num_heads: int
    frames: int = 16
    image_size: int = 224

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.frames // 2, self.image_size // 16, self.image_size // 16

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    def config(self):
        from transformers import VideoMAEConfig

        return VideoMAEConfig(
            num_frames=self.frames,
            image_size=self.image_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.depth,
            num_attention_heads=self.num_heads,
            intermediate_size=4 * self.hidden_size,
        )


TABLE_BACKBONES = [
    VideoBackbone("VideoMAE-S", 384, 12, 6),
    VideoBackbone("VideoMAE-B", 768, 12, 12),
    VideoBackbone("VideoMAE-L", 1024, 24, 16),
    VideoBackbone("VideoMAE-B, 32 frames", 768, 12, 12, frames=32),
]


def landmarks(b: VideoBackbone) -> tuple[int, int, int]:
    """:data:`LANDMARKS`, clamped to the backbone's token grid (for small clips)."""
    return tuple(map(min, LANDMARKS, b.grid))


def full_model_flops(b: VideoBackbone) -> tuple[float, float, int]:
    """(total FLOPs, attention-matmul FLOPs, parameters) of the full-attention ``VideoMAEModel``, on meta."""
    from transformers import VideoMAEModel

    with torch.device("meta"):
        model = VideoMAEModel._from_config(b.config(), attn_implementation="sdpa")
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, b.frames, 3, b.image_size, b.image_size, device="meta"))
    attn = b.depth * b.num_heads * registry.flops("sdpa", b.tokens, b.hidden_size // b.num_heads)
    return float(counter.get_total_flops()), attn, sum(p.numel() for p in model.parameters())


def backbone_row(b: VideoBackbone, counted: bool = True) -> dict[str, float | int | str]:
    """One table row: parameters, full and MiTA GFLOPs (m = k = 98 on a (2, 7, 7) landmark grid), reduction."""
    total, attn, params = full_model_flops(b)
    d, m = b.hidden_size // b.num_heads, math.prod(landmarks(b))
    dense, per_layer = total - attn, b.depth * b.num_heads
    mita = dense + per_layer * mita_formula_flops(b.tokens, d, m, TOPK)
    row: dict[str, float | int | str] = {
        "model": b.name,
        "clip": f"{b.frames}x{b.image_size}x{b.image_size}",
        "N": b.tokens,
        "params (M)": params / 1e6,
        "full GFLOPs": total / 1e9,
        "attention share (%)": 100 * attn / total,
        "MiTA GFLOPs": mita / 1e9,
        "reduction (%)": 100 * (1 - mita / total),
    }
    if counted:
        impl = dense + per_layer * mita_counted_flops(b.tokens, d, b.num_heads, landmarks(b), TOPK, b.grid, 0)
        row["MiTA GFLOPs (counted impl)"] = impl / 1e9
        row["reduction, counted (%)"] = 100 * (1 - impl / total)
    return row
