"""timm integration: the MiTA-DeiT names in timm's registry and :func:`convert` for any timm ViT.

The code lives in :mod:`mita.models` (``convert.py``, ``deit.py``) and :mod:`mita.layers`;
this module gathers it under its old import path, and importing it registers the models.
:mod:`mita.integrations.timm_hook` imports it as soon as timm is imported.
"""

from __future__ import annotations

from ..layers.mita import MiTAVisionAttention
from ..models.convert import convert, revert
from ..models.deit import MITA_OPTIONS, MODEL_NAMES, register_models

__all__ = ["MITA_OPTIONS", "MODEL_NAMES", "MiTAVisionAttention", "convert", "register_models", "revert"]
