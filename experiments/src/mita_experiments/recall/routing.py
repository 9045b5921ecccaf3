"""A prototype MiTA layer for the recall study (issue 31): options that test why MiTA's routing
never reaches the target key in training. The registry knows it as the attention ``mita_recall``
within :func:`registered` (the recall task builds its models there).

With every option at its default the layer is :class:`~mita.layers.MiTAAttention` (the spec's
operator, exactly). The options:

- ``landmark_pooling="distinct"``: each landmark is the mean of its bin's queries weighted by
  1 / (copies of that query vector in the sequence), so a token repeated 192 times (filler,
  padding, a uniform region) weighs as one token, not 192: landmarks by content, not by count.
- ``merge_duplicates=True``: each group of equal key vectors is one key of weight c (its copies):
  the experts hold k distinct keys (the top-k by the shared expert's mass) instead of k copies of
  one, and a kept key's logit is raised by log(c), so its softmax weight is that of all its
  copies (:func:`merged_mita`, on the library's operator).
- ``rope=True``: rotary position embeddings on q and k before the call (spec section 2's
  order), which make identical tokens at different positions distinct.
- ``dense_steps=T`` (training only): the output is ``a * sdpa + (1 - a) * mita`` with ``a``
  falling linearly from 1 to 0 over the first T training forwards, a dense gradient path to
  every key that decays; evaluation (``model.eval()``) is pure MiTA at every step.

The distinct pooling and the duplicate groups are the library's
(:mod:`mita.ops.mita.landmarks`): O(N log N), never an N x N matrix.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from mita.layers.mita import MiTAAttention
from mita.ops.checks import check_int
from mita.ops.mita import MiTARouting, mita_attention, mita_flops
from mita.ops.mita.landmarks import distinct_landmarks, duplicate_groups
from mita.ops.pooling import check_pooling, pool
from mita.registry import REGISTRY, Method, Taxonomy, register

NAME = "mita_recall"
POOLINGS = ("mean", "distinct")


def merged_mita(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    topk: int,
    num_routed: int = 1,
    mask: torch.Tensor | None = None,
    branches: str = "both",
    impl: str = "auto",
) -> tuple[torch.Tensor, MiTARouting, torch.Tensor]:
    """MiTA with each group of equal tokens (equal key and value) merged into one key of weight
    ``c`` (its copies).

    Run on the library's operator (every implementation): the copies of a key but its first are
    masked out (per head: the heads are folded into the batch), and two extra channels carry
    log(c) into the logits, q' = [q, 1, -1], k' = [k, log(c)/s0, 0], landmarks' = [q~, 1, 1]:
    the gate q'.q~' = q.q~ (unchanged), A' = q~.k + log(c)/s0, so the shared expert
    softmax(s0 A') V is the spec's over every copy, each expert holds the top-k distinct keys by
    that shared mass, and a kept key's routed logit is s0 q.k + log(c): its softmax weight is that
    of all its copies (v gets two zero channels, dropped from the output). With no repeated key
    this is the spec's operator. Args as
    :func:`mita.mita_attention` (q, k, v (B, H, N, D), as many kv heads as query heads),
    ``landmarks`` (B, H, m, D), ``mask`` (B, N) bool, True = real token.

    Returns:
        (out (B, H, N, D), :class:`MiTARouting`, bonus (B, H, m, k): each slot's logit offset
        log(c), -inf on a slot that holds no key).
    """
    B, H, N, D = q.shape
    m, s0 = landmarks.shape[2], D**-0.5
    real = torch.ones(B, N, dtype=torch.bool, device=q.device) if mask is None else mask
    copies, first = duplicate_groups(torch.cat([k, v], -1), mask)  # equal keys with equal values
    one = q.new_ones(B, H, N, 1)
    q2 = torch.cat([q, one, -one], -1)
    k2 = torch.cat([k, (copies.log() / s0).to(k.dtype)[..., None], torch.zeros_like(one)], -1)
    lm2 = torch.cat([landmarks, landmarks.new_ones(B, H, m, 2)], -1)
    v2 = torch.cat([v, v.new_zeros(B, H, N, 2)], -1)  # the op takes v of k's width
    out, r = mita_attention(
        *(t.flatten(0, 1)[:, None] for t in (q2, k2, v2)),
        num_landmarks=m,
        topk=topk,
        num_routed=num_routed,
        key_padding_mask=first.flatten(0, 1),
        query_padding_mask=real[:, None].expand(B, H, N).flatten(0, 1),
        scale=s0,
        landmark_scale=s0,
        landmarks=lm2.flatten(0, 1)[:, None],
        branches=branches,
        impl=impl,
        return_routing=True,
    )
    experts, routes = r.experts.view(B, H, m, -1), r.routes.view(B, H, N, -1)
    held = first.gather(2, experts.flatten(2)).view(experts.shape)
    bonus = copies.log().gather(2, experts.flatten(2)).view(experts.shape).masked_fill(~held, -math.inf)
    return out.view(B, H, N, D + 2)[..., :D], MiTARouting(landmarks, experts, routes), bonus


def rotary(x: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x (B, H, N, D) at positions 0 .. N-1; D even."""
    N, D = x.shape[-2], x.shape[-1]
    freq = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angle = torch.arange(N, device=x.device, dtype=torch.float32)[:, None] * freq
    cos, sin = angle.cos().repeat(1, 2).to(x.dtype), angle.sin().repeat(1, 2).to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RecallMiTAAttention(MiTAAttention):
    """:class:`~mita.layers.MiTAAttention` with the study's options (module docstring).

    Args:
        landmark_pooling (str): "mean" (the spec's) or "distinct" (repeated queries count once).
            Default: "mean".
        merge_duplicates (bool): experts hold distinct keys, a kept key's logit + log(copies).
            Default: False.
        rope (bool): rotary position embeddings on q and k. Default: False.
        dense_steps (int): training forwards over which a dense (sdpa) share of the output
            falls from 1 to 0; 0 = off. Never used in evaluation. Default: 0.
        *args, **kwargs: :class:`~mita.layers.MiTAAttention`'s (1-D pooling only).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        landmark_pooling: str = "mean",
        merge_duplicates: bool = False,
        rope: bool = False,
        dense_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if landmark_pooling not in POOLINGS:
            raise ValueError(f"landmark_pooling must be one of {list(POOLINGS)}, got {landmark_pooling!r}")
        for name, value in (("merge_duplicates", merge_duplicates), ("rope", rope)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if self.grid is not None or self.compat is not None or self.num_prefix_tokens:
            raise ValueError("mita_recall is 1-D only: leave grid, compat and num_prefix_tokens at their defaults")
        if rope and self.head_dim % 2:
            raise ValueError(f"rope=True needs an even head dim, got {self.head_dim}")
        self.landmark_pooling, self.merge_duplicates, self.rope = landmark_pooling, merge_duplicates, rope
        self.dense_steps = check_int("dense_steps", dense_steps, 0)
        if self.dense_steps:  # the schedule's clock, saved with the weights (exact resume)
            self.register_buffer("dense_step", torch.zeros((), dtype=torch.long))
        self.attended_qk: tuple[torch.Tensor, torch.Tensor] | None = None  # q, k as attended (record_routing)
        self.expert_bonus: torch.Tensor | None = None  # merge_duplicates: each slot's logit offset

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, landmark_pooling={self.landmark_pooling}, "
            f"merge_duplicates={self.merge_duplicates}, rope={self.rope}, dense_steps={self.dense_steps}"
        )

    def dense_share(self) -> float:
        """The dense share a of the next forward: 1 - step / dense_steps in training, 0 in evaluation."""
        if not (self.training and self.dense_steps):
            return 0.0
        return max(0.0, 1.0 - float(self.dense_step) / self.dense_steps)

    def attend(self, q, k, v, key_padding_mask, is_causal):
        if self.rope:
            q, k = rotary(q), rotary(k)
        if k.shape[1] != q.shape[1]:
            raise ValueError("mita_recall takes as many kv heads as query heads")
        m = self.num_landmarks
        landmarks = None
        if self.landmark_pooling == "distinct":
            landmarks = distinct_landmarks(q, m, query_padding_mask=key_padding_mask)
        if self.merge_duplicates:
            if landmarks is None:  # the spec's pooling
                landmarks = pool(q, check_pooling(m, None, 0, q.shape[2]), key_padding_mask)
            out, routing, bonus = merged_mita(
                q, k, v, landmarks, self.topk, self.num_routed, key_padding_mask, self.branches, self.impl
            )
        else:
            res = mita_attention(
                q,
                k,
                v,
                num_landmarks=m,
                topk=self.topk,
                num_routed=self.num_routed,
                key_padding_mask=key_padding_mask,
                query_padding_mask=key_padding_mask,
                landmarks=landmarks,
                dropout_p=self.dropout_p,
                branches=self.branches,
                impl=self.impl,
                return_routing=self.record_routing,
            )
            out, routing, bonus = (res if self.record_routing else (res, None)) + (None,)
        share = self.dense_share()
        if self.training and self.dense_steps:
            self.dense_step += 1
        if share > 0:
            mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
            out = share * F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + (1 - share) * out
        if self.record_routing:
            self.routing, self.expert_bonus, self.attended_qk = routing, bonus, (q.detach(), k.detach())
        return out


METHOD = Method(
    name=NAME,
    taxonomy=Taxonomy("compression + routing", "m", "MLP (softmax)", "content-dependent (landmark probing)", "N-to-m"),
    op=mita_attention,
    layer=RecallMiTAAttention,
    defaults={"num_landmarks": 64, "topk": 64},
    flops=mita_flops,  # the options add O(N log N) sorting only
    cost="N D (8m + 4sk)",
    paper="Wen et al. 2026 (arXiv 2602.01219), with the recall study's options (issue 31)",
)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """Within the block the registry knows ``mita_recall``; it is removed again after, so the
    library's registry (and whatever lists every method) is the same outside."""
    added = NAME not in REGISTRY
    if added:
        register(METHOD)
    try:
        yield
    finally:
        if added:
            REGISTRY.pop(NAME, None)
