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


# (name, branches, scaling, expert count, topology, cost, paper note)
_VARIANTS = [
    ("mita", "both", "compression + routing", "m", "N-to-m", "N D (8m + 4sk)", ""),
    ("mita_routed", "routed", "routing", "m", "N-to-m", "N D (4m + 4sk)", ", ablation: routed experts only"),
    ("mita_shared", "shared", "compression", "1", "all-to-one", "8 N m D", ", ablation: shared expert only"),
]
for name, branches, scaling, count, topology, cost, note in _VARIANTS:
    register(
        Method(
            name=name,
            taxonomy=Taxonomy(scaling, count, "MLP (softmax)", LANDMARK_PROBING, topology),
            op=mita_attention,
            layer=MiTAAttention,
            defaults={"num_landmarks": 64, "topk": 64, **({} if branches == "both" else {"branches": branches})},
            flops=mita_flops,
            cost=cost,
            paper=PAPER + note,
        )
    )
