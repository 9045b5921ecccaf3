"""``MiTAAttention``: timm's ``Attention`` with MiTA in place of softmax attention, and
``MiTAVisionAttention``, the same with the extras of the authors' MiTA-DeiT models."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.checks import check_int
from ..ops.mita import IMPLEMENTATIONS, MERGING, MiTARouting, mita_attention, official_landmarks
from ..ops.mita.config import check_repeat_options
from .base import (
    AttentionLayer,
    GridOption,
    PatchGrid,
    check_bins,
    check_grid_option,
    conv_values,
    depthwise_conv,
    resolve_grid,
)


class MiTAAttention(AttentionLayer):
    """Multi-head self-attention with MiTA; a drop-in for ``timm.models.vision_transformer.Attention``.

    ``num_landmarks``, ``topk``, ``num_routed`` are attributes, checked when set: change them
    on a trained module to run it with other values. With ``record_routing = True`` the last
    call's landmarks, experts and routes are kept in ``.routing`` for analysis.

    Args:
        dim (int): token width C of the input (B, N, C).
        num_heads (int): attention heads. Default: 8.
        num_landmarks (int | tuple): m, as in :func:`mita.mita_attention`. Default: 25.
        topk (int): keys per expert. Default: 25.
        num_routed (int): experts per query. Default: 1.
        grid (tuple | str | None): None (1-D pooling), (gh, gw), (gt, gh, gw) (video), or
            "auto" (a square grid of N - num_prefix_tokens: images). Default: None.
        num_prefix_tokens (int): leading tokens (CLS, registers) that are not pooled (nor rotated by
            ``rope``). Default: 0.
        num_suffix_tokens (int): trailing tokens (ViT-5's registers) that are not pooled. Default: 0.
        compat (str | None): "official" reproduces the authors' code (spec section 2): without suffix
            tokens their DeiT's (the first N - 1 tokens pooled on a floor(sqrt(N)) square), with them
            their ViT-5's (the tokens between prefix and suffix pooled on a square); both scale the
            landmark logits by 1/D. Default: None.
        branches (str): "both", or the ablations "shared" / "routed". Default: "both".
        landmark_pooling (str): "mean" (the spec's) or "distinct": each query weighted by 1 / its
            copies in the sequence, so repeated tokens (filler, padding, uniform regions) count once
            in the landmarks (issue 31, ``docs/recall.md``). Default: "mean".
        merge_duplicates (bool): each group of equal (key, value) pairs is one key of weight c (its
            copies): experts hold distinct keys and a kept key's logit is raised by log c. Any impl
            but "triton" ("auto" takes the grouped path on CUDA). Default: False.
        impl (str): "auto", "fused", "triton", "grouped" or "reference" (see :func:`mita.mita_attention`).
            Default: "auto".
        *args (Any): :class:`~mita.layers.AttentionLayer`'s positional arguments after ``num_heads``.
        **kwargs (Any): :class:`~mita.layers.AttentionLayer`'s (timm's ``Attention`` arguments, the
            ``AttentionRope`` / ``EvaAttention`` layouts).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        num_landmarks: int | tuple[int, ...] = 25,
        topk: int = 25,
        num_routed: int = 1,
        grid: GridOption = None,
        num_prefix_tokens: int = 0,
        num_suffix_tokens: int = 0,
        compat: Literal["official"] | None = None,
        branches: Literal["both", "shared", "routed"] = "both",
        landmark_pooling: Literal["mean", "distinct"] = "mean",
        merge_duplicates: bool = False,
        impl: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dim, num_heads, *args, num_prefix_tokens=num_prefix_tokens, num_suffix_tokens=num_suffix_tokens, **kwargs
        )
        if compat not in (None, "official"):
            raise ValueError(f"compat must be None or 'official', got {compat!r}")
        if impl not in ("auto", *IMPLEMENTATIONS):
            raise ValueError(f"impl must be one of {['auto', *IMPLEMENTATIONS]}, got {impl!r}")
        if branches not in ("both", "shared", "routed"):
            raise ValueError(f"branches must be 'both', 'shared' or 'routed', got {branches!r}")
        check_repeat_options(landmark_pooling, merge_duplicates)
        if compat is not None and (landmark_pooling != "mean" or merge_duplicates):
            raise ValueError(
                "compat='official' reproduces the authors' operator: leave landmark_pooling='mean' and "
                "merge_duplicates=False, or pass compat=None"
            )
        if merge_duplicates and impl not in ("auto", *MERGING):
            raise ValueError(f"merge_duplicates=True runs on impl 'auto' or one of {list(MERGING)}, got impl={impl!r}")
        self.landmark_pooling, self.merge_duplicates = landmark_pooling, merge_duplicates
        self.grid, self.compat, self.impl = check_grid_option(grid), compat, impl
        if compat == "official" and self.grid is None:  # the authors pool on a square of patches
            self.grid = "auto"
        self.num_landmarks, self.topk, self.num_routed = num_landmarks, topk, num_routed
        m = math.prod(self.num_landmarks) if isinstance(self.num_landmarks, tuple) else self.num_landmarks
        if self.num_routed > m:
            raise ValueError(f"num_routed must be an int in [1, num_landmarks={m}], got {num_routed!r}")
        self.branches = branches  # "both", or an ablation: "shared" / "routed"
        self.record_routing = False  # set True to keep the last call's MiTARouting in .routing
        self.routing: MiTARouting | None = None
        self.patch_grid: PatchGrid | None = None  # the running forward's patch grid (models of varying image size)

    @property
    def num_landmarks(self) -> int | tuple[int, ...]:
        """m: an int, or (mh, mw) / (mt, mh, mw) with a grid; checked for the layer's grid when set."""
        return self._num_landmarks

    @num_landmarks.setter
    def num_landmarks(self, value: int | tuple[int, ...]) -> None:
        self._num_landmarks = check_bins("num_landmarks", value, "auto" if self.compat == "official" else self.grid)

    @property
    def topk(self) -> int:
        """k, the keys of each expert (an int >= 1, clamped to the real keys per call)."""
        return self._topk

    @topk.setter
    def topk(self, value: int) -> None:
        self._topk = check_int("topk", value)

    @property
    def num_routed(self) -> int:
        """s, the experts each query is routed to (an int >= 1; at most m, checked per call)."""
        return self._num_routed

    @num_routed.setter
    def num_routed(self, value: int) -> None:
        self._num_routed = check_int("num_routed", value)

    def extra_repr(self) -> str:
        return (
            f"num_landmarks={self.num_landmarks}, topk={self.topk}, num_routed={self.num_routed}, "
            f"grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}, "
            f"num_suffix_tokens={self.num_suffix_tokens}, compat={self.compat}, "
            f"landmark_pooling={self.landmark_pooling}, merge_duplicates={self.merge_duplicates}"
        )

    def resolve_grid(self, n: int) -> tuple[int, ...] | None:
        """The grid for a sequence of n tokens: the running forward's patch grid, or ``grid`` ("auto": a square)."""
        return resolve_grid(self.grid, n, self.num_prefix_tokens, self.patch_grid, self.num_suffix_tokens)

    def attend(self, q, k, v, key_padding_mask, is_causal):
        kwargs = dict(
            num_landmarks=self.num_landmarks,
            topk=self.topk,
            num_routed=self.num_routed,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,  # self-attention: the queries are the keys
            dropout_p=self.dropout_p,
            branches=self.branches,
            landmark_pooling=self.landmark_pooling,
            merge_duplicates=self.merge_duplicates,
            impl=self.impl,
        )
        if self.compat == "official":  # the authors' landmark logits: q . q~ / D
            kwargs.update(landmark_scale=self.head_dim**-1.0)
        if self.compat == "official" and not self.num_suffix_tokens:  # their DeiT's landmarks
            kwargs.update(landmarks=official_landmarks(q, self.num_landmarks))
        else:  # the spec's; their ViT-5 pools the patch queries on their square, which is the same
            kwargs.update(
                grid=self.resolve_grid(q.shape[2]),
                num_prefix_tokens=self.num_prefix_tokens,
                num_suffix_tokens=self.num_suffix_tokens,
            )
        if not self.record_routing:
            return mita_attention(q, k, v, **kwargs)
        out, self.routing = mita_attention(q, k, v, **kwargs, return_routing=True)
        return out


class MiTAVisionAttention(MiTAAttention):
    """:class:`MiTAAttention` with the two extras of the authors' MiTA-DeiT models.

    Args:
        dwc (bool): add a depth-wise convolution of V over the patch grid (3x3, or 3x3x3 on a
            3-D grid) to the attention output (zero on the prefix and suffix tokens); it restores the
            locality that sparse routing loses. Needs a grid. Default: False.
        out_gate (bool): multiply ``SiLU(x W_g)`` into the attention output before ``proj``.
            The authors' gated checkpoints fuse ``qkv`` and ``W_g`` into one ``qkvg``
            projection; such a state dict is split on load. Default: False.
        *args (Any): :class:`MiTAAttention`'s positional arguments after ``num_heads``.
        **kwargs (Any): :class:`MiTAAttention`'s keyword arguments.
    """

    def __init__(
        self, dim: int, num_heads: int = 8, *args: Any, dwc: bool = False, out_gate: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if dwc and self.grid is None:
            raise ValueError("dwc=True needs a patch grid: pass grid='auto' or grid=(gh, gw)")
        dd, c = self.dd, self.attn_dim
        self.dwc = depthwise_conv(c, self.grid, dd) if dwc else None
        qkv_bias = (self.qkv if self.qkv is not None else self.q_proj).bias is not None or self.q_bias is not None
        self.out_gate = nn.Linear(dim, c, bias=qkv_bias, **dd) if out_gate else None
        if self.out_gate is not None:  # timm's ViT init for linear layers
            nn.init.trunc_normal_(self.out_gate.weight, std=0.02)
            if self.out_gate.bias is not None:
                nn.init.zeros_(self.out_gate.bias)
        self._gate_value: torch.Tensor | None = None  # SiLU(x W_g) of the running forward

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._gate_value = F.silu(self.out_gate(x)) if self.out_gate is not None else None
        try:
            return super().forward(x, attn_mask, is_causal, rope=rope)
        finally:
            self._gate_value = None

    def attend(self, q, k, v, key_padding_mask, is_causal):
        out = super().attend(q, k, v, key_padding_mask, is_causal)
        B, H, N, D = v.shape
        if self.dwc is not None:
            grid, suffix = self.resolve_grid(N), self.num_suffix_tokens
            out = out + conv_values(self.dwc, v, N - math.prod(grid) - suffix, grid, key_padding_mask, suffix)
        if self._gate_value is not None:
            out = out * self._gate_value.reshape(B, N, H, D).transpose(1, 2)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Split the authors' fused ``qkvg`` projection into ``qkv`` and ``out_gate``."""
        for kind in ("weight", "bias"):
            fused = state_dict.pop(f"{prefix}qkvg.{kind}", None)
            if fused is not None:
                c3 = fused.shape[0] // 4 * 3
                state_dict[f"{prefix}qkv.{kind}"], state_dict[f"{prefix}out_gate.{kind}"] = fused[:c3], fused[c3:]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
