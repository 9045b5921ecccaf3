"""Attention layers (``nn.Module``s), drop-ins for timm's ``Attention``."""

from .agent import AgentAttention
from .base import AttentionLayer
from .mita import MiTAAttention, MiTAVisionAttention
from .op import OpAttention

__all__ = ["AgentAttention", "AttentionLayer", "MiTAAttention", "MiTAVisionAttention", "OpAttention"]
