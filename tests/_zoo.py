"""Helpers the zoo tests share: random inputs, padding masks, dense attention written out."""

from __future__ import annotations

import torch

from mita import attention as registry

F64 = torch.float64


IMPLEMENTED = registry.names()


CAUSAL = ["sdpa", "topk", "moba", "linear"]  # the registered ops with a causal form
#: the registered ops without attention probabilities: dropout_p > 0 is a ValueError
NO_DROPOUT = ["linear", "nystrom", "flatten", "inline", "pola", "mhla", "ttt_linear", "ttt_mlp"]


def qkv(B=2, H=4, Hkv=2, Nq=37, Nk=37, D=8, dtype=F64, device="cpu"):
    """Random (B, H, Nq, D) queries and (B, Hkv, Nk, D) keys and values."""
    q = torch.randn(B, H, Nq, D, dtype=dtype, device=device)
    return (
        q,
        torch.randn(B, Hkv, Nk, D, dtype=dtype, device=device),
        torch.randn(B, Hkv, Nk, D, dtype=dtype, device=device),
    )


def padding(B: int, N: int, lengths: list[int], device="cpu") -> torch.Tensor:
    """Bool (B, N) mask with the first lengths[b] tokens real."""
    return torch.arange(N, device=device)[None] < torch.tensor(lengths, device=device)[:, None]


def dense(q, k, v, mask=None, causal=False):
    """Softmax attention written out: GQA heads repeated, padded keys and (causal) future keys at -inf."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = torch.ones(logits.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    out = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1) @ v
    return out if mask is None else out.masked_fill(~mask[:, None, :, None], 0)


def _small(name: str) -> dict:
    """Options that make each method non-trivial at the tiny test sizes."""
    return {
        "mita": {"num_landmarks": 4, "topk": 5},
        "mita_routed": {"num_landmarks": 4, "topk": 5},
        "mita_shared": {"num_landmarks": 4},
        "topk": {"topk": 5},
        "moba": {"block_size": 4, "topk": 2},
        "agent": {"num_agents": 4},
        "nystrom": {"num_landmarks": 4},
        "mhla": {"num_blocks": 4},
        "ttt_linear": {"mini_batch_size": 8, "inner_lr": 0.1},
        "ttt_mlp": {"mini_batch_size": 8},
        "nsa": {"block_size": 4, "topk": 2, "window": 3},
    }.get(name, {})


#: the modules a method's layer adds to timm's Attention (its learned parts; mita.convert will not drop them)
LAYER_EXTRAS = {
    "flatten": {"feature_scale"},
    "inline": {"residual"},
    "pola": {"power", "feature_scale"},
    "mhla": {"mixing"},
    "ttt_linear": {"inner"},
    "ttt_mlp": {"inner"},
    "nsa": {"gate_proj"},
}
