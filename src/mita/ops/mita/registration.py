"""MiTA's entry in the attention registry."""

from __future__ import annotations

from ...attention import Method, Taxonomy, register
from ...layers.mita import MiTAAttention
from . import mita_attention


def mita_flops(n: int, d: int, num_landmarks: int = 64, topk: int = 64, num_routed: int = 1, **_) -> float:
    """Spec section 3: N D (8m + 4sk) per head (top-k and routing, O(mN), not counted)."""
    m = num_landmarks if isinstance(num_landmarks, int) else num_landmarks[0] * num_landmarks[1]
    return n * d * (8 * m + 4 * num_routed * min(topk, n))


register(
    Method(
        name="mita",
        taxonomy=Taxonomy(
            "compression + routing", "m", "MLP (softmax)", "content-dependent: landmark probing + top-k", "N-to-m"
        ),
        op=mita_attention,
        layer=MiTAAttention,
        defaults={"num_landmarks": 64, "topk": 64},
        flops=mita_flops,
        cost="N D (8m + 4sk)",
        paper="Wen et al. 2026 (arXiv 2602.01219)",
    )
)
