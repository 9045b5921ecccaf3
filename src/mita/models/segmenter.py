"""Segmenter (Strudel et al., ICCV 2021) with any registered attention: semantic segmentation with a ViT.

The encoder is a timm ``VisionTransformer`` whose attention :func:`~mita.models.convert.convert`
swapped (MiTA by default, m = k = 49 as the MiTA paper runs it at 512 px, pooled on the patch
grid of each input); the decoder is either of the Segmenter paper's:

* :class:`LinearDecoder`: a linear classifier on each patch token;
* :class:`MaskTransformer`: ``num_classes`` learned class embeddings join the patch tokens in a
  few transformer blocks, and each class's mask is the product of the normalised patch and class
  features. Its attention is any registered method too; the class tokens lead the sequence and
  are its prefix tokens (``num_prefix_tokens = num_classes``), so landmark pooling (MiTA, agent
  attention, ...) pools the patches alone, on their grid.

The masks are upsampled bilinearly to the input. An input whose sides are not multiples of the
patch size is padded with zeros to the next multiple and the output cropped back.
:meth:`Segmenter.slide` predicts images larger than the training crop by sliding a window.

Parameter names are those of the Segmenter code (``encoder.*`` a timm ViT without its head,
``decoder.cls_emb``, ``decoder.proj_dec``, ``decoder.blocks.*``, ``decoder.proj_patch``,
``decoder.proj_classes``, ``decoder.decoder_norm``, ``decoder.mask_norm``; ``decoder.head`` for
the linear decoder), so its checkpoints load after :func:`segmenter_state_dict`. Needs timm.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models.vision_transformer import Block, VisionTransformer

from .. import attention as registry
from ..layers.base import PatchGrid
from ..ops.checks import check_int
from .convert import convert

__all__ = [
    "DEFAULT_ATTENTION",
    "SIZES",
    "LinearDecoder",
    "MaskTransformer",
    "Segmenter",
    "create_segmenter",
    "segmenter_state_dict",
]

#: the encoder attention of the MiTA paper's Segmenter at 512 px (N = 1,025)
DEFAULT_ATTENTION = "mita:num_landmarks=49,topk=49"
#: (embed_dim, depth, num_heads) of the ViT sizes the Segmenter paper trains
SIZES: dict[str, tuple[int, int, int]] = {
    "tiny": (192, 12, 3),
    "small": (384, 12, 6),
    "base": (768, 12, 12),
    "large": (1024, 24, 16),
}
Decoder = Literal["mask_transformer", "linear"]


def _init_linear(module: nn.Module) -> None:
    """timm's ViT initialisation: truncated normal (std 0.02) weights, zero biases; LayerNorms at 1 and 0."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _convert_tokens(module: nn.Module, attention: registry.Config, grid: bool) -> None:
    """``convert(module, attention)``; with ``grid``, methods that pool on a grid get ``grid="auto"`` (a module
    without a patch embedding, as the decoder, cannot tell :func:`convert` its grid) unless the config names one."""
    if attention == "timm":
        convert(module, "timm")
        return
    name, options = registry.parse(attention)
    extra = {}
    if grid and "grid" not in options and "grid" in registry.layer_options(registry.get(name)):
        extra["grid"] = "auto"
    convert(module, attention, **extra)


class LinearDecoder(nn.Module):
    """The Segmenter paper's linear decoder: each patch token (B, N, C) classified by one linear layer.

    Args:
        encoder_dim (int): C, the encoder's token width.
        num_classes (int): K, the classes.
    """

    num_prefix_tokens = 0

    def __init__(self, encoder_dim: int, num_classes: int) -> None:
        super().__init__()
        self.num_classes = check_int("num_classes", num_classes)
        self.head = nn.Linear(check_int("encoder_dim", encoder_dim), self.num_classes)
        self.apply(_init_linear)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch tokens (B, gh * gw, C) in row order to class logits (B, K, gh, gw)."""
        return self.head(x).transpose(1, 2).unflatten(2, grid)


class MaskTransformer(nn.Module):
    """The Segmenter paper's Mask Transformer decoder.

    The patch tokens are projected to ``embed_dim``; ``num_classes`` learned class embeddings lead
    them through ``depth`` pre-norm transformer blocks (timm's ``Block``, attention swapped for
    ``attention``); after a LayerNorm, patch and class features are projected, L2-normalised and
    multiplied, giving one mask logit per patch and class, LayerNorm-ed over the classes.

    Args:
        encoder_dim (int): C, the encoder's token width.
        num_classes (int): K, the classes (and class tokens).
        embed_dim (int | None): the decoder's width; None takes ``encoder_dim``. Default: None.
        depth (int): transformer blocks. Default: 2 (the Segmenter paper's).
        num_heads (int | None): attention heads; None takes ``embed_dim // 64`` (at least 1). Default: None.
        mlp_ratio (float): MLP width over ``embed_dim``. Default: 4.0.
        attention (str | dict): any registered attention config, or "timm" / "sdpa" for softmax
            attention; the class tokens are its prefix tokens, never pooled. Default: "sdpa".
        dropout (float): dropout on the attention probabilities and after each projection. Default: 0.0.
        drop_path_rate (float): stochastic depth, rising linearly to this over the blocks. Default: 0.0.
    """

    def __init__(
        self,
        encoder_dim: int,
        num_classes: int,
        embed_dim: int | None = None,
        depth: int = 2,
        num_heads: int | None = None,
        mlp_ratio: float = 4.0,
        attention: registry.Config = "sdpa",
        dropout: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        encoder_dim, self.num_classes = check_int("encoder_dim", encoder_dim), check_int("num_classes", num_classes)
        self.embed_dim = check_int("embed_dim", embed_dim) if embed_dim is not None else encoder_dim
        depth = check_int("depth", depth)
        num_heads = check_int("num_heads", num_heads) if num_heads is not None else max(1, self.embed_dim // 64)
        if self.embed_dim % num_heads:
            raise ValueError(f"the decoder's embed_dim={self.embed_dim} must be divisible by num_heads={num_heads}")
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # rising linearly, as timm's
        self.proj_dec = nn.Linear(encoder_dim, self.embed_dim)
        self.blocks = nn.ModuleList(
            Block(
                self.embed_dim,
                num_heads,
                mlp_ratio,
                qkv_bias=True,
                proj_drop=dropout,
                attn_drop=dropout,
                drop_path=rate,
            )
            for rate in rates
        )
        self.cls_emb = nn.Parameter(torch.zeros(1, self.num_classes, self.embed_dim))
        scale = self.embed_dim**-0.5
        self.proj_patch = nn.Parameter(scale * torch.randn(self.embed_dim, self.embed_dim))
        self.proj_classes = nn.Parameter(scale * torch.randn(self.embed_dim, self.embed_dim))
        self.decoder_norm = nn.LayerNorm(self.embed_dim)
        self.mask_norm = nn.LayerNorm(self.num_classes)
        self.apply(_init_linear)
        trunc_normal_(self.cls_emb, std=0.02)
        if attention not in ("timm", "sdpa"):
            _convert_tokens(self, attention, grid=True)

    @property
    def num_prefix_tokens(self) -> int:
        """The class tokens lead the decoder's sequence: layers that pool tokens leave them out."""
        return self.num_classes

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Patch tokens (B, gh * gw, C) in row order to mask logits (B, K, gh, gw)."""
        x = self.proj_dec(x)
        x = torch.cat([self.cls_emb.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x)
        x = self.decoder_norm(x)
        classes, patches = x[:, : self.num_classes] @ self.proj_classes, x[:, self.num_classes :] @ self.proj_patch
        masks = F.normalize(patches, dim=-1) @ F.normalize(classes, dim=-1).transpose(1, 2)
        return self.mask_norm(masks).transpose(1, 2).unflatten(2, grid)


class Segmenter(nn.Module):
    """A timm ViT encoder and a Segmenter decoder: images (B, 3, H, W) to class logits (B, K, H, W).

    Args:
        encoder (VisionTransformer): a timm ViT (its head is not used); ``dynamic_img_size=True``
            lets it take crops and windows of any size (:func:`create_segmenter` builds one so).
        num_classes (int): K. Default: 150 (ADE20K).
        decoder (str): "mask_transformer" or "linear". Default: "mask_transformer".
        attention (str | dict | None): the encoder's attention, any registered config (MiTA pools
            its landmarks on each input's patch grid); None keeps the encoder's. Default: None.
        decoder_attention (str | dict): the Mask Transformer's attention. Default: "sdpa".
        decoder_depth (int): Mask Transformer blocks. Default: 2.
        decoder_heads (int | None): its heads (None: width // 64). Default: None.
        dropout (float): the decoder's dropout. Default: 0.0.
        drop_path_rate (float): the decoder's stochastic depth. Default: 0.0.
    """

    def __init__(
        self,
        encoder: VisionTransformer,
        num_classes: int = 150,
        decoder: Decoder = "mask_transformer",
        attention: registry.Config | None = None,
        decoder_attention: registry.Config = "sdpa",
        decoder_depth: int = 2,
        decoder_heads: int | None = None,
        dropout: float = 0.0,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, VisionTransformer):
            raise TypeError(f"encoder must be a timm VisionTransformer, got {type(encoder).__name__}")
        if decoder not in ("mask_transformer", "linear"):
            raise ValueError(f"decoder must be 'mask_transformer' or 'linear', got {decoder!r}")
        self.num_classes = check_int("num_classes", num_classes)
        self.patch_size = tuple(int(p) for p in encoder.patch_embed.patch_size)
        self.encoder = encoder
        if decoder == "linear":
            self.decoder: nn.Module = LinearDecoder(encoder.embed_dim, self.num_classes)
        else:
            self.decoder = MaskTransformer(
                encoder.embed_dim,
                self.num_classes,
                depth=decoder_depth,
                num_heads=decoder_heads,
                attention=decoder_attention,
                dropout=dropout,
                drop_path_rate=drop_path_rate,
            )
        self.patch_grid = PatchGrid()
        self.set_attention(attention)

    def set_attention(self, attention: registry.Config | None = None, decoder: registry.Config | None = None) -> None:
        """Swap the encoder's attention for ``attention`` and the Mask Transformer's for ``decoder``, in
        place, keeping the weights (None leaves one as it is; "timm" puts softmax attention back).
        The attention swap of the MiTA paper: a model trained with one attention run with another."""
        if attention is not None:
            convert(self.encoder, attention)
        if decoder is not None:
            if not isinstance(self.decoder, MaskTransformer):
                raise ValueError("the linear decoder has no attention to swap; pass decoder=None")
            _convert_tokens(self.decoder, decoder, grid=True)
        for module in self.modules():  # every layer pools on the grid of the running input
            if hasattr(module, "patch_grid") and module is not self:
                module.patch_grid = self.patch_grid

    def no_weight_decay(self) -> set[str]:
        """Position, class-token and class-embedding parameters: no weight decay (timm's and Segmenter's rule)."""
        return {f"encoder.{name}" for name in self.encoder.no_weight_decay()} | {"decoder.cls_emb"}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (B, K, H, W) of ``images`` (B, C, H, W), zero-padded to patch multiples inside."""
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"Segmenter takes images of shape (B, C, H, W), got {got}")
        H, W = images.shape[-2:]
        ph, pw = self.patch_size
        Hp, Wp = math.ceil(H / ph) * ph, math.ceil(W / pw) * pw
        if (Hp, Wp) != (H, W):
            images = F.pad(images, (0, Wp - W, 0, Hp - H))
        grid = (Hp // ph, Wp // pw)
        self.patch_grid.current = grid
        x = self.encoder.forward_features(images)[:, self.encoder.num_prefix_tokens :]
        masks = self.decoder(x, grid)
        masks = F.interpolate(masks, size=(Hp, Wp), mode="bilinear", align_corners=False)
        return masks[..., :H, :W]

    @torch.no_grad()
    def slide(
        self,
        images: torch.Tensor,
        window: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        batch_size: int = 8,
    ) -> torch.Tensor:
        """Class logits (B, K, H, W) of ``images`` (B, C, H, W) by sliding-window inference.

        Windows of ``window`` px (an int or (h, w)) start every ``stride`` px (default: the window,
        no overlap; the last window of a row or column is moved in to end at the border), and
        each pixel's logits are the mean over the windows that hold it. A side shorter than the
        window is taken whole (the forward pads it to the patch size), so a window that covers
        the image gives the whole-image forward exactly. ``batch_size`` windows run per forward.
        """
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            raise ValueError("slide takes images of shape (B, C, H, W)")
        wh, ww = (window, window) if isinstance(window, int) else tuple(window)
        stride = (wh, ww) if stride is None else stride
        sh, sw = (stride, stride) if isinstance(stride, int) else tuple(stride)
        for name, value in (("window", wh), ("window", ww), ("stride", sh), ("stride", sw)):
            check_int(name, value)
        check_int("batch_size", batch_size)
        B, _, H, W = images.shape
        wh, ww = min(wh, H), min(ww, W)
        rows = sorted({*range(0, H - wh, sh), H - wh})
        cols = sorted({*range(0, W - ww, sw), W - ww})
        anchors = [(r, c) for r in rows for c in cols]
        logits = images.new_zeros(B, self.num_classes, H, W)
        counts = images.new_zeros(1, 1, H, W)
        crops = torch.cat([images[:, :, r : r + wh, c : c + ww] for r, c in anchors])  # window-major
        outputs = torch.cat([self(crops[i : i + batch_size]) for i in range(0, len(crops), batch_size)])
        for (r, c), out in zip(anchors, outputs.split(B)):
            logits[:, :, r : r + wh, c : c + ww] += out
            counts[:, :, r : r + wh, c : c + ww] += 1
        return logits / counts


def create_segmenter(
    size: str = "small",
    num_classes: int = 150,
    img_size: int = 512,
    patch_size: int = 16,
    in_chans: int = 3,
    decoder: Decoder = "mask_transformer",
    attention: registry.Config = DEFAULT_ATTENTION,
    decoder_attention: registry.Config = "sdpa",
    drop_path_rate: float = 0.1,
    **kwargs: Any,
) -> Segmenter:
    """A Segmenter with a timm ViT encoder of ``size`` ("tiny", "small", "base", "large") at ``img_size``.

    The encoder takes inputs of any size (``dynamic_img_size``; position embeddings resampled);
    ``attention`` is any registered config (default: MiTA, m = k = 49), ``"sdpa"`` for timm's
    softmax attention. ``kwargs`` go to :class:`Segmenter` (``decoder_depth``, ``decoder_heads``,
    ``dropout``, ``decoder_attention``) or, given as ``embed_dim``, ``depth``, ``num_heads``,
    ``mlp_ratio``, to the encoder (overriding ``size``'s).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    embed_dim, depth, num_heads = SIZES[size]
    vit = {"embed_dim": embed_dim, "depth": depth, "num_heads": num_heads, "mlp_ratio": 4.0}
    vit.update({key: kwargs.pop(key) for key in list(kwargs) if key in vit})
    encoder = VisionTransformer(
        img_size=img_size,
        patch_size=patch_size,
        in_chans=in_chans,
        num_classes=0,
        global_pool="",
        qkv_bias=True,
        drop_path_rate=drop_path_rate,
        dynamic_img_size=True,
        **vit,
    )
    return Segmenter(
        encoder,
        num_classes,
        decoder,
        attention=None if attention in ("sdpa", "timm") else attention,
        decoder_attention=decoder_attention,
        **kwargs,
    )


def segmenter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of the Segmenter code (and of the MiTA authors' fork) for :class:`Segmenter`.

    Takes the checkpoint's model dict (``checkpoint["model"]``). Drops the encoder's ImageNet head
    (``encoder.head.*``, unused by segmentation); the rest keeps its names. A distilled DeiT
    encoder (``encoder.dist_token``) has no place in a timm ``VisionTransformer``: a ValueError.
    """
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise TypeError("state must be a dict of tensors (a Segmenter checkpoint's 'model' entry)")
    if "encoder.dist_token" in state:
        raise ValueError("the checkpoint's encoder is a distilled DeiT (encoder.dist_token): not supported")
    return {k: v for k, v in state.items() if not k.startswith("encoder.head.")}
