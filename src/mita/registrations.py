"""The library's attention methods in the registry: each op with its layer, taxonomy and cost.

Ops (``mita.ops``) and layers (``mita.layers``) know nothing of the registry; this module
imports both and registers them. Adding a method: write its op under ``mita/ops/`` (and a
layer under ``mita/layers/`` if it needs parameters), then one :func:`register` call here.
"""

from __future__ import annotations

from .layers.agent import AgentAttention
from .layers.kernelized import FLattenAttention, InLineAttention, PolaAttention
from .layers.mhla import MHLAAttention
from .layers.mita import MiTAAttention
from .layers.nsa import NSAAttention
from .layers.ttt import TTTLinearAttention, TTTMLPAttention
from .ops.agent import agent_attention, agent_flops
from .ops.flatten import flatten_flops, focused_linear_attention
from .ops.inline import inline_attention, inline_flops
from .ops.linear import linear_attention, linear_flops
from .ops.mhla import mhla_attention, mhla_flops
from .ops.mita import mita_attention, mita_flops
from .ops.moba import moba_attention, moba_flops
from .ops.nsa import nsa_attention, nsa_flops
from .ops.nystrom import nystrom_attention, nystrom_flops
from .ops.polaformer import pola_flops, polarity_linear_attention
from .ops.sdpa import sdpa_attention
from .ops.topk import topk_attention, topk_flops
from .ops.ttt import ttt_flops, ttt_linear_attention
from .ops.ttt_mlp import ttt_mlp_attention, ttt_mlp_flops
from .registry import Method, Taxonomy, register

LANDMARK_PROBING = "content-dependent (landmark probing)"
MITA_PAPER = "Wen et al. 2026 (arXiv 2602.01219)"

register(
    Method(
        name="sdpa",
        taxonomy=Taxonomy("none (full attention)", "1 (width N)", "MLP (softmax)", "all tokens", "all-to-one"),
        op=sdpa_attention,
        flops=lambda n, d, **_: 4 * n * n * d,
        cost="4 N^2 D",
        paper="Vaswani et al. 2017",
    )
)

# MiTA and the paper's two ablations: (name, branches, scaling, expert count, topology, cost, paper note)
_MITA_VARIANTS = [
    ("mita", "both", "compression + routing", "m", "N-to-m", "N D (8m + 4sk)", ""),
    ("mita_routed", "routed", "routing", "m", "N-to-m", "N D (4m + 4sk)", ", ablation: routed experts only"),
    ("mita_shared", "shared", "compression", "1", "all-to-one", "8 N m D", ", ablation: shared expert only"),
]
for name, branches, scaling, count, topology, cost, note in _MITA_VARIANTS:
    register(
        Method(
            name=name,
            taxonomy=Taxonomy(scaling, count, "MLP (softmax)", LANDMARK_PROBING, topology),
            op=mita_attention,
            layer=MiTAAttention,
            defaults={"num_landmarks": 64, "topk": 64, **({} if branches == "both" else {"branches": branches})},
            flops=mita_flops,
            cost=cost,
            paper=MITA_PAPER + note,
        )
    )

register(
    Method(
        name="topk",
        taxonomy=Taxonomy("routing", "N", "MLP (softmax)", "content-dependent (top-k)", "N times one-to-one"),
        op=topk_attention,
        defaults={"topk": 64},
        flops=topk_flops,
        cost="2 N^2 D + 2 N k D",
        paper="top-k attention (Gupta et al. 2021; Wang et al. 2022)",
    )
)
register(
    Method(
        name="moba",
        taxonomy=Taxonomy("routing", "N/n", "MLP (softmax)", "position-driven (blocks, locality prior)", "N-to-N/n"),
        op=moba_attention,
        defaults={"block_size": 64, "topk": 2},
        flops=moba_flops,
        cost="2 N^2 D / b + 4 N k b D",
        paper="Lu et al. 2025",
    )
)
register(
    Method(
        name="linear",
        taxonomy=Taxonomy("compression", "1", "linear", "content-dependent (kernelization)", "all-to-one"),
        op=linear_attention,
        flops=linear_flops,
        cost="4 N D^2",
        paper="Katharopoulos et al. 2020",
    )
)
register(
    Method(
        name="agent",
        taxonomy=Taxonomy("compression", "1", "MLP (softmax)", LANDMARK_PROBING, "all-to-one"),
        op=agent_attention,
        layer=AgentAttention,
        defaults={"num_agents": 64},
        flops=agent_flops,
        cost="8 N n D",
        paper="Han et al. 2024",
    )
)
register(
    Method(
        name="nystrom",
        taxonomy=Taxonomy(
            "compression", "1", "MLP (softmax)", "content-dependent (landmark probing: segment means)", "all-to-one"
        ),
        op=nystrom_attention,
        defaults={"num_landmarks": 64},
        flops=nystrom_flops,
        cost="8 N m D + 4 m^2 D + 48 m^3",
        paper="Xiong et al. 2021",
    )
)


# The kernelized linear attentions of the authors' ImageNet comparison, TTT-Linear, TTT-MLP and NSA (issue 28),
# all bidirectional. Each has its own layer: its learned parameters (feature scales, exponents, the
# local residual's predictor, the inner models' initial weights, the block mixing, NSA's gates) live there.
KERNELIZATION = "content-dependent (kernelization"
register(
    Method(
        name="flatten",
        taxonomy=Taxonomy("compression", "1", "linear", f"{KERNELIZATION}: focused ReLU features)", "all-to-one"),
        op=focused_linear_attention,
        layer=FLattenAttention,
        flops=flatten_flops,
        cost="4 N D^2",
        paper="Han et al. 2023 (FLatten Transformer, ICCV)",
    )
)
register(
    Method(
        name="inline",
        taxonomy=Taxonomy(
            "compression", "1", "linear", f"{KERNELIZATION}: identity, injective normalisation)", "all-to-one"
        ),
        op=inline_attention,
        layer=InLineAttention,
        flops=inline_flops,
        cost="4 N D^2",
        paper="Han et al. 2024 (InLine attention, NeurIPS)",
    )
)
register(
    Method(
        name="pola",
        taxonomy=Taxonomy(
            "compression", "1", "linear", f"{KERNELIZATION}: polarity-aware power features)", "all-to-one"
        ),
        op=polarity_linear_attention,
        layer=PolaAttention,
        flops=pola_flops,
        cost="8 N D^2",
        paper="Meng et al. 2025 (PolaFormer, ICLR)",
    )
)
register(
    Method(
        name="mhla",
        taxonomy=Taxonomy(
            "compression + routing",
            "m",
            "linear",
            "position-driven (token blocks, summaries mixed by block distance)",
            "N-to-m",
        ),
        op=mhla_attention,
        layer=MHLAAttention,
        defaults={"num_blocks": 16},
        flops=mhla_flops,
        cost="4 N D^2 + 2 m^2 D^2",
        paper="Zhang et al. 2026 (MHLA, ICLR; arXiv 2601.07832)",
    )
)
register(
    Method(
        name="ttt_linear",
        taxonomy=Taxonomy(
            "compression", "1", "linear (a learned model)", "content-dependent (test-time training)", "all-to-one"
        ),
        op=ttt_linear_attention,
        layer=TTTLinearAttention,
        flops=ttt_flops,
        cost="6 N D^2",
        paper="Sun et al. 2024 (TTT-Linear), bidirectional as in ViT^3 (Han et al. 2025)",
    )
)
register(
    Method(
        name="ttt_mlp",
        taxonomy=Taxonomy(
            "compression", "1", "arbitrary (a learned model)", "content-dependent (test-time training)", "all-to-one"
        ),
        op=ttt_mlp_attention,
        layer=TTTMLPAttention,
        flops=ttt_mlp_flops,
        cost="14 N D h (h = 4D: 56 N D^2)",
        paper="Sun et al. 2024 (TTT-MLP), bidirectional as ViT^3 uses TTT-Linear (Han et al. 2025)",
    )
)
register(
    Method(
        name="nsa",
        taxonomy=Taxonomy(
            "compression + routing", "N/n", "MLP (softmax)", "position-driven (blocks, locality prior)", "N-to-N/n"
        ),
        op=nsa_attention,
        layer=NSAAttention,
        defaults={"block_size": 64, "topk": 4, "window": 64},
        flops=nsa_flops,
        cost="4 N D (N/b + k b + 2w + 1) (compressed, selected, window branches)",
        paper="Yuan et al. 2025 (Native Sparse Attention), bidirectional",
    )
)

# The paper's methods the library does not implement: taxonomy rows only (``op=None``); building
# one by name raises a ValueError that says so. Linformer is placed as in spec section 5 (as NSA is,
# above), the other rows are this library's reading of each method in the same five dimensions.
for method in (
    Method(
        name="linformer",
        taxonomy=Taxonomy("compression", "1", "MLP (softmax)", "position-driven (learned projection)", "all-to-one"),
        cost="4 N p D (p projected keys)",
        paper="Wang et al. 2020",
    ),
    Method(
        name="performer",
        taxonomy=Taxonomy(
            "compression", "1", "linear", "content-dependent (kernelization: random features)", "all-to-one"
        ),
        cost="4 N r D (r random features)",
        paper="Choromanski et al. 2021",
    ),
    Method(
        name="swin",
        taxonomy=Taxonomy("routing", "N/n", "MLP (softmax)", "position-driven (windows)", "N-to-N/n (own window)"),
        cost="4 N w D (w tokens per window)",
        paper="Liu et al. 2021 (Swin Transformer)",
    ),
    Method(
        name="deformable",
        taxonomy=Taxonomy(
            "routing",
            "N",
            "arbitrary (predicted weights)",
            "content-dependent (predicted offsets)",
            "N times one-to-one",
        ),
        cost="O(N P D) (P sampling points)",
        paper="Zhu et al. 2021 (Deformable DETR)",
    ),
):
    register(method)
