"""Attention layers (``nn.Module``s), drop-ins for timm's ``Attention``."""

from .base import AttentionLayer
from .mita import MiTAAttention

__all__ = ["AttentionLayer", "MiTAAttention"]
