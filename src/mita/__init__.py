"""mita: MiTA attention (Mixture of Top-k Activations) for PyTorch.

``mita.mita_attention`` is the functional op on (B, H, N, D) tensors,
``mita.MiTAAttention`` the drop-in for timm's ``Attention`` and
``mita.attention`` the registry of every attention method the library has.
"""

from . import attention
from .integrations.timm_hook import install as _install_timm_models
from .layers import AttentionLayer, MiTAAttention
from .ops.mita import MiTARouting, mita_attention

__version__ = "0.1.0"
__all__ = ["AttentionLayer", "MiTAAttention", "MiTARouting", "__version__", "attention", "convert", "mita_attention"]

_install_timm_models()  # the mita_deit_* names in timm's registry, once timm is imported


def __getattr__(name: str):
    """``mita.convert`` (timm ViT attention swap) is imported on first use: it needs timm."""
    if name == "convert":
        from .models.convert import convert

        return convert
    raise AttributeError(f"module 'mita' has no attribute {name!r}")
