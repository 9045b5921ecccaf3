"""Attention layers (``nn.Module``s), drop-ins for timm's ``Attention``."""

from .agent import AgentAttention
from .base import AttentionLayer
from .kernelized import FLattenAttention, InLineAttention, PolaAttention
from .mhla import MHLAAttention
from .mita import MiTAAttention, MiTAVisionAttention
from .nsa import NSAAttention
from .op import OpAttention
from .ttt import TTTLinearAttention, TTTMLPAttention

__all__ = [
    "AgentAttention",
    "AttentionLayer",
    "FLattenAttention",
    "InLineAttention",
    "MHLAAttention",
    "MiTAAttention",
    "MiTAVisionAttention",
    "NSAAttention",
    "OpAttention",
    "PolaAttention",
    "TTTLinearAttention",
    "TTTMLPAttention",
]
