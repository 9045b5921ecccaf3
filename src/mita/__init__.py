"""mita: MiTA attention (Mixture of Top-k Activations) for PyTorch.

``mita.mita_attention`` is the functional op on (B, H, N, D) tensors,
``mita.MiTAAttention`` the drop-in for timm's ``Attention`` and
``mita.attention`` the registry of every attention method the library has.
"""

from . import attention
from .layers import AttentionLayer, MiTAAttention
from .ops.mita import MiTARouting, mita_attention

__version__ = "0.1.0"
__all__ = ["AttentionLayer", "MiTAAttention", "MiTARouting", "__version__", "attention", "mita_attention"]
