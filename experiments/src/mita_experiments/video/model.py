"""A small video ViT: tubelet embedding, learned positions, timm blocks, mean-pooled head.

Its patch embedding says its 3-D token grid (``patch_embed.grid_size``, ``num_prefix_tokens = 0``),
so :func:`mita.convert` gives its MiTA layers the (gt, gh, gw) landmark grid.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class TubeletEmbed(nn.Module):
    """(B, T, C, H, W) clips to (B, N, dim) tokens, one per ``tubelet`` = (t, h, w) block, in (time, row, column) order.

    Args:
        frames (int), size (int), channels (int): the clips' T, H = W and C.
        tubelet (tuple): (t, h, w) of each token's block. Default: (2, 4, 4).
        dim (int): token width. Default: 64.
    """

    def __init__(self, frames: int, size: int, channels: int, tubelet=(2, 4, 4), dim: int = 64) -> None:
        super().__init__()
        if frames % tubelet[0] or size % tubelet[1] or size % tubelet[2]:
            raise ValueError(
                f"tubelet {tuple(tubelet)} must divide the clip's (frames, size, size) = {(frames, size, size)}"
            )
        self.grid_size = (frames // tubelet[0], size // tubelet[1], size // tubelet[2])
        self.proj = nn.Conv3d(channels, dim, kernel_size=tuple(tubelet), stride=tuple(tubelet))

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        return self.proj(clips.transpose(1, 2)).flatten(2).transpose(1, 2)


class VideoViT(nn.Module):
    """A ViT over tubelets for video classification (softmax attention; :func:`mita.convert` swaps it).

    Args:
        frames (int), size (int), channels (int): the clips' T, H = W and C.
        num_classes (int): outputs.
        tubelet (tuple): (t, h, w). Default: (2, 4, 4).
        embed_dim (int), depth (int), num_heads (int): the transformer. Defaults: 64, 3, 4.
        mlp_ratio (float): MLP width over embed_dim. Default: 2.0.
    """

    num_prefix_tokens = 0

    def __init__(
        self,
        frames: int,
        size: int,
        channels: int,
        num_classes: int,
        tubelet=(2, 4, 4),
        embed_dim: int = 64,
        depth: int = 3,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
    ) -> None:
        from timm.models.vision_transformer import Block

        super().__init__()
        self.patch_embed = TubeletEmbed(frames, size, channels, tubelet, embed_dim)
        n = self.patch_embed.grid_size[0] * self.patch_embed.grid_size[1] * self.patch_embed.grid_size[2]
        self.pos_embed = nn.Parameter(torch.randn(1, n, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True) for _ in range(depth)))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        """(B, T, C, H, W) clips to (B, num_classes) logits."""
        x = self.blocks(self.patch_embed(clips) + self.pos_embed)
        return self.head(self.norm(x).mean(1))
