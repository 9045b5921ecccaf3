"""What the timm-registered MiTA models share: their pretrained config and loading a local checkpoint.

No model here has downloadable weights; a checkpoint of the authors' code is given as a file
(``pretrained_cfg_overlay=dict(file=...)``) and loaded by timm's ``load_pretrained``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from timm.models import load_pretrained


def pretrained_cfg(**kwargs: Any) -> dict[str, Any]:
    """timm's pretrained config of an ImageNet model at 224 px without a download URL; kwargs override."""
    return {
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
        **kwargs,
    }


def load_local_checkpoint(model: nn.Module, variant: str, filter_fn: Callable | None = None) -> None:
    """Load the checkpoint file the model's pretrained config names, or say how to give one."""
    cfg = model.pretrained_cfg
    if not (cfg.get("file") or cfg.get("state_dict")):
        raise ValueError(
            f"{variant} has no downloadable weights; pass pretrained_cfg_overlay=dict(file='checkpoint.pth') "
            "with a checkpoint of the authors' code, or load it with model.load_state_dict"
        )
    load_pretrained(model, pretrained_cfg=cfg, num_classes=model.num_classes, filter_fn=filter_fn)
