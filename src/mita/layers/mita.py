"""``MiTAAttention``: timm's ``Attention`` with MiTA in place of softmax attention."""

from __future__ import annotations

import math
from typing import Literal

from ..ops.mita import MiTARouting, mita_attention, official_landmarks
from .base import AttentionLayer


class MiTAAttention(AttentionLayer):
    """Multi-head self-attention with MiTA; a drop-in for ``timm.models.vision_transformer.Attention``.

    ``num_landmarks``, ``topk``, ``num_routed`` are plain attributes: change them on a
    trained module to run it with other values. ``grid`` is None (1-D pooling), (gh, gw),
    or "auto" (a square grid from the token count minus the prefix). ``compat="official"``
    reproduces the authors' DeiT code (spec section 2). With ``record_routing = True`` the
    last call's landmarks, experts and routes are kept in ``.routing`` for analysis.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args,
        num_landmarks: int | tuple[int, int] = 25,
        topk: int = 25,
        num_routed: int = 1,
        grid: tuple[int, int] | Literal["auto"] | None = None,
        num_prefix_tokens: int = 0,
        compat: Literal["official"] | None = None,
        branches: Literal["both", "shared", "routed"] = "both",
        impl: str = "auto",
        **kwargs,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if compat not in (None, "official"):
            raise ValueError(f"compat must be None or 'official', got {compat!r}")
        if not (grid is None or grid == "auto" or (isinstance(grid, (tuple, list)) and len(grid) == 2)):
            raise ValueError(f"grid must be None, 'auto' or a pair (gh, gw), got {grid!r}")
        self.num_landmarks, self.topk, self.num_routed = num_landmarks, topk, num_routed
        self.grid, self.num_prefix_tokens, self.compat, self.impl = grid, num_prefix_tokens, compat, impl
        self.branches = branches  # "both", or an ablation: "shared" / "routed"
        self.record_routing = False  # set True to keep the last call's MiTARouting in .routing
        self.routing: MiTARouting | None = None

    def extra_repr(self) -> str:
        return (
            f"num_landmarks={self.num_landmarks}, topk={self.topk}, num_routed={self.num_routed}, "
            f"grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}, compat={self.compat}"
        )

    def resolve_grid(self, n: int) -> tuple[int, int] | None:
        """The 2-D grid for a sequence of n tokens ("auto": square of n - prefix)."""
        if self.grid != "auto":
            return None if self.grid is None else tuple(self.grid)
        side = math.isqrt(n - self.num_prefix_tokens)
        if side * side != n - self.num_prefix_tokens:
            raise ValueError(
                f"grid='auto' needs a square number of pooled tokens, got N - num_prefix_tokens = "
                f"{n} - {self.num_prefix_tokens}; pass grid=(gh, gw)"
            )
        return side, side

    def attend(self, q, k, v, key_padding_mask, is_causal):
        kwargs = dict(
            num_landmarks=self.num_landmarks, topk=self.topk, num_routed=self.num_routed,
            key_padding_mask=key_padding_mask, dropout_p=self.dropout_p, branches=self.branches, impl=self.impl,
        )  # fmt: skip
        if self.compat == "official":
            kwargs.update(landmarks=official_landmarks(q, self.num_landmarks), landmark_scale=self.head_dim**-1.0)
        else:
            kwargs.update(grid=self.resolve_grid(q.shape[2]), num_prefix_tokens=self.num_prefix_tokens)
        if not self.record_routing:
            return mita_attention(q, k, v, **kwargs)
        out, self.routing = mita_attention(q, k, v, **kwargs, return_routing=True)
        return out
