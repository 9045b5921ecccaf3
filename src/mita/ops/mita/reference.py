"""Reference MiTA attention: the spec's steps, one after the other, for reading and testing.

Quadratic in memory (every query gathers its routed keys explicitly); it is the oracle
the fast paths (:mod:`~mita.ops.mita.grouped`, :mod:`~mita.ops.mita.fused`) are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import topk_indices
from ..pooling import pool_reference
from ..tiling import zero_padding
from .config import MiTAConfig


def mita_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: MiTAConfig,
    landmarks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """MiTA attention by the spec's steps; returns (out, (landmarks, experts, routes))."""
    B, H, Nq, D = q.shape
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):  # half precision is computed in float32
        q, k, v = q.float(), k.float(), v.float()
        landmarks = None if landmarks is None else landmarks.float()
    G = H // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # grouped-query heads share kv heads
    v = v.repeat_interleave(G, dim=1)
    q, k, v = zero_padding(q, k, v, cfg)  # padded tokens take no part anywhere

    # 1. Landmarks Q~ (B, H, m, D).
    if landmarks is None:
        landmarks = pool_reference(q, cfg.pooling, cfg.query_mask)

    # 2. Affinities A = Q~ K^T (B, H, m, Nk); padded keys are -inf.
    A = landmarks @ k.transpose(-1, -2)
    if cfg.key_mask is not None:
        A = A.masked_fill(~cfg.key_mask[:, None, None, :], float("-inf"))
    # merge_duplicates: each group of equal keys is its first key with the logit offset log(copies)
    # (-inf on the other copies), so s0 A is the log of the group's mass in the shared expert.
    offset = None
    if cfg.key_offset is not None:
        offset = cfg.key_offset.repeat_interleave(G, dim=1).to(A.dtype)  # (B, H, Nk)
        A = A + offset[:, :, None, :] / cfg.scale

    # 3. Shared expert: values V~ = softmax(s0 A) V; its keys are the landmarks.
    v_shared = torch.softmax(cfg.scale * A, dim=-1) @ v

    # 4. Deformable experts: the top-k keys of each landmark (B, H, m, k); equal keys by lower index.
    experts = topk_indices(A, cfg.topk)

    # 5. Routing: each query goes to the s landmarks with the largest gate q . q~ (ties: lower landmark).
    gate = q @ landmarks.transpose(-1, -2)  # (B, H, Nq, m)
    routes = topk_indices(gate, cfg.num_routed)  # (B, H, Nq, s)

    # 6. One softmax over [landmarks ; keys of every routed expert] for each query.
    idx = torch.gather(
        experts.unsqueeze(2).expand(B, H, Nq, cfg.m, cfg.topk),
        3,
        routes.unsqueeze(-1).expand(B, H, Nq, cfg.num_routed, cfg.topk),
    ).flatten(3)  # (B, H, Nq, s*k) key positions, repeats kept
    keys = torch.gather(k.unsqueeze(2).expand(B, H, Nq, -1, D), 3, idx.unsqueeze(-1).expand(-1, -1, -1, -1, D))
    vals = torch.gather(v.unsqueeze(2).expand(B, H, Nq, -1, D), 3, idx.unsqueeze(-1).expand(-1, -1, -1, -1, D))
    routed = cfg.scale * (keys @ q.unsqueeze(-1)).squeeze(-1)  # (B, H, Nq, s*k)
    if cfg.key_mask is not None:  # clamped k: slots past a short sequence's real keys
        real = torch.gather(cfg.key_mask[:, None, None, :].expand(B, H, Nq, -1), 3, idx)
        routed = routed.masked_fill(~real, float("-inf"))
    if offset is not None:  # a kept key weighs as all its copies; a slot past the distinct keys is -inf
        routed = routed + torch.gather(offset[:, :, None, :].expand(B, H, Nq, -1), 3, idx)
    # (The ablations keep one part: "shared" drops the routed keys, "routed" the landmarks.)
    shared_values = v_shared.unsqueeze(2).expand(B, H, Nq, cfg.m, D)
    parts = ([(cfg.landmark_scale * gate, shared_values)] if cfg.use_shared else []) + (
        [(routed, vals)] if cfg.use_routed else []
    )
    p = torch.softmax(torch.cat([logit for logit, _ in parts], dim=-1), dim=-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    out = (p.unsqueeze(-2) @ torch.cat([value for _, value in parts], dim=-2)).squeeze(-2)

    # 7. Padded query rows are zero.
    if cfg.query_mask is not None:
        out = out.masked_fill(~cfg.query_mask[:, None, :, None], 0)
    return out.to(dtype), (landmarks.to(dtype), experts, routes)
