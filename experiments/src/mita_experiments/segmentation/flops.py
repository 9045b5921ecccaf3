"""FLOPs of the whole Segmenter (encoder and Mask Transformer decoder) at 512 x 512 (``mita seg flops``).

Counted as ``mita vision flops`` counts ViTs (:mod:`mita_experiments.vision.flops`; FLOPs = 2 x
MACs, batch 1): the whole model with softmax attention in encoder and decoder by
``torch.utils.flop_counter.FlopCounterMode`` on the meta device (patch embedding, every linear
layer, the decoder's mask products and the attention matmuls, 4 N^2 D per head and layer; the
final bilinear upsampling of the masks is not a matmul and is not counted), then each
attention's matmuls replaced by MiTA's formula plus its selection work (per head
N D (8m + 4sk) + top-k, routing and gather), and by FlopCounterMode on this library's grouped
MiTA path ("counted impl"). The encoder has N = 1,025 tokens at 512 px (32 x 32 patches and
CLS), the decoder N + 149 (the 1,024 patches and 150 class tokens, the class tokens its prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from mita import attention as registry

from ..vision.flops import mita_counted_flops, mita_formula_flops

#: the paper's claim on ADE20K (Segmenter, 512 x 512)
PAPER_CLAIM = "up to 42% fewer FLOPs than the full-attention model, mIoU within 1.2-2.8 points (ADE20K, 512x512)"
M = K = 49
IMAGE = 512
CLASSES = 150


@dataclass(frozen=True)
class SegmenterSize:
    """A Segmenter at ``image`` px with 16 px patches: the ViT size and the Mask Transformer's depth."""

    name: str
    size: str
    image: int = IMAGE
    decoder_depth: int = 2

    def model(self) -> torch.nn.Module:
        """The softmax-attention Segmenter on the meta device (no memory, no arithmetic)."""
        from mita.models.segmenter import create_segmenter

        with torch.device("meta"):
            return create_segmenter(
                self.size,
                num_classes=CLASSES,
                img_size=self.image,
                attention="sdpa",
                decoder_depth=self.decoder_depth,
                drop_path_rate=0.0,
            )


TABLE = [SegmenterSize("Seg-T/16", "tiny"), SegmenterSize("Seg-S/16", "small"), SegmenterSize("Seg-B/16", "base")]


def segmenter_row(s: SegmenterSize, counted: bool = True) -> dict[str, float | int | str]:
    """One row: parameters, full GFLOPs, the attention's share, and MiTA (m = k = 49) in the encoder alone
    and in encoder and decoder, with their reductions."""
    model = s.model()
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, s.image, s.image, device="meta"))
    total = float(counter.get_total_flops())
    encoder, decoder = model.encoder, model.decoder
    grid = (s.image // 16, s.image // 16)
    n_enc, n_dec = grid[0] * grid[1] + 1, grid[0] * grid[1] + CLASSES
    d_enc = encoder.embed_dim // encoder.blocks[0].attn.num_heads
    heads_dec = decoder.blocks[0].attn.num_heads
    d_dec = decoder.embed_dim // heads_dec
    enc_layers, dec_layers = len(encoder.blocks) * encoder.blocks[0].attn.num_heads, len(decoder.blocks) * heads_dec
    attn_enc = enc_layers * registry.flops("sdpa", n_enc, d_enc)
    attn_dec = dec_layers * registry.flops("sdpa", n_dec, d_dec)
    mita_enc = enc_layers * mita_formula_flops(n_enc, d_enc, M, K)
    mita_dec = dec_layers * mita_formula_flops(n_dec, d_dec, M, K)
    encoder_only = total - attn_enc + mita_enc
    both = encoder_only - attn_dec + mita_dec
    row: dict[str, float | int | str] = {
        "model": s.name,
        "image": f"{s.image}x{s.image}",
        "N (enc / dec)": f"{n_enc} / {n_dec}",
        "params (M)": sum(p.numel() for p in model.parameters()) / 1e6,
        "full GFLOPs": total / 1e9,
        "attention share (%)": 100 * (attn_enc + attn_dec) / total,
        "MiTA enc GFLOPs": encoder_only / 1e9,
        "reduction enc (%)": 100 * (1 - encoder_only / total),
        "MiTA enc+dec GFLOPs": both / 1e9,
        "reduction enc+dec (%)": 100 * (1 - both / total),
    }
    if counted:
        impl_enc = enc_layers * mita_counted_flops(n_enc, d_enc, encoder.blocks[0].attn.num_heads, M, K, grid, 1)
        impl_dec = dec_layers * mita_counted_flops(n_dec, d_dec, heads_dec, M, K, grid, CLASSES)
        impl = total - attn_enc - attn_dec + impl_enc + impl_dec
        row["reduction enc+dec, counted impl (%)"] = 100 * (1 - impl / total)
    return row
