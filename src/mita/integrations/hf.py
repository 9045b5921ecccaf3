"""Hugging Face transformers integration: ``attn_implementation="mita"`` for encoder models.

``import mita.integrations.hf`` registers ``"mita"`` with transformers' ``AttentionInterface``
(the attention itself) and ``AttentionMaskInterface`` (so the model hands over its padding
mask as a (B, N) bool mask instead of an N x N one). Then::

    model = AutoModel.from_config(ViTConfig(mita_num_landmarks=25, mita_topk=25), attn_implementation="mita")

MiTA options are read from the model config; defaults for vision configs (those with
``image_size`` and ``patch_size``) / for the others (BERT, ...):

- ``mita_num_landmarks``: 25 (a 5x5 grid) / 64
- ``mita_topk``: 25 / 64
- ``mita_num_routed``: 1 / 1
- ``mita_grid``: "auto" (the square patch grid) / None (1-D pooling); or [gh, gw]
- ``mita_num_prefix_tokens``: 1 (CLS) / 0

MiTA has no causal form yet: decoder models and causal calls raise a ``ValueError``. Padding is
said per side: in self-attention the padding mask marks the queries too; a cross-attention module
(``is_cross_attention`` or a ``...CrossAttention`` class) is never taken for self-attention.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, sdpa_mask

from ..ops.mita import mita_attention

NAME = "mita"


def is_vision_config(config: Any) -> bool:
    """A ViT-like config: images cut into patches (the patch grid gives 2-D landmark pooling)."""
    return hasattr(config, "image_size") and hasattr(config, "patch_size")


def mita_options(config: Any, num_tokens: int) -> dict[str, Any]:
    """The MiTA arguments for a sequence of ``num_tokens`` tokens of a model with this config."""
    vision = is_vision_config(config)
    default_m = 25 if vision else 64
    options = {
        "num_landmarks": getattr(config, "mita_num_landmarks", default_m),
        "topk": getattr(config, "mita_topk", default_m),
        "num_routed": getattr(config, "mita_num_routed", 1),
        "num_prefix_tokens": getattr(config, "mita_num_prefix_tokens", 1 if vision else 0),
    }
    grid = getattr(config, "mita_grid", "auto" if vision else None)
    if grid == "auto":
        pooled = num_tokens - options["num_prefix_tokens"]
        side = math.isqrt(max(pooled, 0))
        if side * side != pooled:
            raise ValueError(
                f"config.mita_grid='auto' needs a square patch grid, but {num_tokens} tokens minus "
                f"{options['num_prefix_tokens']} prefix tokens is {pooled}; set config.mita_grid = [gh, gw] or None"
            )
        grid = (side, side)
    elif grid is not None:
        if not (isinstance(grid, (list, tuple)) and len(grid) == 2):
            raise ValueError(f"config.mita_grid must be 'auto', None or [gh, gw], got {grid!r}")
        grid = (int(grid[0]), int(grid[1]))
    options["grid"] = grid
    return options


def key_padding_mask(attention_mask: torch.Tensor | None, batch: int, kv_length: int) -> torch.Tensor | None:
    """HF's mask (2-D 1/0, 4-D bool, or 4-D additive float) as a (B, Nk) bool mask, True = real key.

    A 4-D mask is accepted only if it is a pure padding mask (the same key pattern in every row).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor or None for MiTA, got {type(attention_mask).__name__}")
    mask = attention_mask
    if mask.dim() == 4:
        full = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 = attend
        keys = full.any(dim=-2)[:, 0]
        if not bool((full == keys[:, None, None, :]).all()):
            raise ValueError(
                "MiTA accepts only padding masks (every query sees the same real keys); this 4-D attention_mask "
                "is causal or otherwise structured"
            )
        mask = keys
    elif mask.dim() == 2:
        mask = mask.bool()
    else:
        raise ValueError(f"attention_mask must be 2-D (B, N) or 4-D (B, 1, Nq, Nk), got shape {tuple(mask.shape)}")
    if tuple(mask.shape) != (batch, kv_length):
        raise ValueError(f"attention_mask covers {tuple(mask.shape)} but the keys are (B={batch}, Nk={kv_length})")
    return None if bool(mask.all()) else mask


def mita_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=bidirectional_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask-creation hook: a plain padding mask stays (B, N); anything else is built as SDPA's."""
    if mask_function is bidirectional_mask_function and q_offset == 0 and kv_offset == 0:
        return None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def mita_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, N, D) in, ((B, N, H, D), no weights) out."""
    if is_causal or (is_causal is None and getattr(module, "is_causal", False)):
        raise ValueError(
            f"attn_implementation='mita' has no causal form yet ({type(module).__name__} is causal); "
            "use it with encoder models (ViT, BERT, ...) or pick 'sdpa' for decoders"
        )
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='mita' does not return attention weights; use output_attentions=False")
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no .config to read the MiTA options from")
    B, _, Nq, _ = query.shape
    mask = key_padding_mask(attention_mask, B, key.shape[2])
    # Padding per side: self-attention's queries are its keys; a cross-attention module's queries
    # are other tokens, whose padding HF does not hand over (never taken for self-attention).
    cross = bool(getattr(module, "is_cross_attention", False)) or "CrossAttention" in type(module).__name__
    query_mask = torch.ones(B, Nq, dtype=torch.bool, device=query.device) if cross else None
    if not cross and mask is not None and Nq == key.shape[2]:
        query_mask = mask
    out = mita_attention(
        query,
        key,
        value,
        **mita_options(config, Nq),
        key_padding_mask=mask,
        query_padding_mask=query_mask,
        scale=scaling,
        dropout_p=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"mita"`` with transformers (idempotent); done on import of this module."""
    AttentionInterface.register(NAME, mita_attention_forward)
    AttentionMaskInterface.register(NAME, mita_mask)


register()
