"""The paper's methods that the library does not implement: taxonomy rows only (``op=None``).

``mita taxonomy`` prints them marked "no" so the table covers the paper's comparison;
building one by name raises a ValueError that says so. The placements of Linformer and
NSA follow spec section 5; the other rows are this library's reading of each method in
the same five dimensions.
"""

from __future__ import annotations

from ..attention import Method, Taxonomy, register

for method in (
    Method(
        name="ttt",
        taxonomy=Taxonomy(
            "compression", "1", "arbitrary (a learned model)", "content-dependent (test-time training)", "all-to-one"
        ),
        cost="O(N D^2) for a linear inner model",
        paper="Sun et al. 2024 (TTT layers)",
    ),
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
        name="nsa",
        taxonomy=Taxonomy(
            "compression + routing", "N/n", "MLP (softmax)", "position-driven (blocks, locality prior)", "N-to-N/n"
        ),
        cost="4 N D (N/l + k b + w) (compressed, selected, window branches)",
        paper="Yuan et al. 2025 (Native Sparse Attention)",
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
