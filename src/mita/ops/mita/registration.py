"""MiTA's entries in the attention registry: MiTA and the paper's two ablations."""

from __future__ import annotations

from ...attention import Method, Taxonomy, register
from ...layers.mita import MiTAAttention
from . import mita_attention

LANDMARK_PROBING = "content-dependent (landmark probing)"
PAPER = "Wen et al. 2026 (arXiv 2602.01219)"


def _m(num_landmarks: int | tuple[int, int]) -> int:
    return num_landmarks if isinstance(num_landmarks, int) else num_landmarks[0] * num_landmarks[1]


def mita_flops(
    n: int, d: int, num_landmarks: int = 64, topk: int = 64, num_routed: int = 1, branches: str = "both", **_
) -> float:
    """Spec section 3: N D (8m + 4sk) per head (top-k and routing, O(mN), not counted).

    The ablations drop their branch: "shared" the routed keys (8 N m D), "routed" the
    shared values and their logits (N D (4m + 4sk)).
    """
    m, routed = _m(num_landmarks), 4 * num_routed * min(topk, n)
    return n * d * {"both": 8 * m + routed, "shared": 8 * m, "routed": 4 * m + routed}[branches]


register(
    Method(
        name="mita",
        taxonomy=Taxonomy("compression + routing", "m", "MLP (softmax)", LANDMARK_PROBING, "N-to-m"),
        op=mita_attention,
        layer=MiTAAttention,
        defaults={"num_landmarks": 64, "topk": 64},
        flops=mita_flops,
        cost="N D (8m + 4sk)",
        paper=PAPER,
    )
)

register(
    Method(
        name="mita_routed",
        taxonomy=Taxonomy("routing", "m", "MLP (softmax)", LANDMARK_PROBING, "N-to-m"),
        op=mita_attention,
        layer=MiTAAttention,
        defaults={"num_landmarks": 64, "topk": 64, "branches": "routed"},
        flops=mita_flops,
        cost="N D (4m + 4sk)",
        paper=f"{PAPER}, ablation: routed experts only",
    )
)

register(
    Method(
        name="mita_shared",
        taxonomy=Taxonomy("compression", "1", "MLP (softmax)", LANDMARK_PROBING, "all-to-one"),
        op=mita_attention,
        layer=MiTAAttention,
        defaults={"num_landmarks": 64, "topk": 64, "branches": "shared"},
        flops=mita_flops,
        cost="8 N m D",
        paper=f"{PAPER}, ablation: shared expert only",
    )
)
