"""LRA models: a pre-norm Transformer encoder classifier with any registered attention.

The attention of every block is ``mita.attention.build_layer(config, dim, num_heads)``,
so ``"sdpa"``, ``"mita:num_landmarks=32,topk=32"`` or any other registered method
plugs in. Padding reaches the attention as a bool (B, N) mask, True = real token.
``pooling="none"`` makes it a token classifier (logits (B, N, classes); the recall task),
and tokens (B, N, C) hold C channels of ids whose embeddings are summed (channel 0 marks
the real tokens).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn as nn

from mita import attention as registry


def _prefix_option(config: registry.Config, num_prefix: int) -> registry.Config:
    """Add ``num_prefix_tokens`` to the config when the method takes it (MiTA: the CLS token is not pooled)."""
    method, _ = registry.resolve(config)
    name, options = registry.parse(config)
    accepts = [fn for fn in (method.layer, method.op) if fn is not None]
    if num_prefix and any("num_prefix_tokens" in inspect.signature(fn).parameters for fn in accepts):
        options.setdefault("num_prefix_tokens", num_prefix)
    return {"name": name, **options}


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_dim: int,
        attention: registry.Config,
        head_dim: int | None,
        dropout: float,
        attn_dropout: float,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = registry.build_layer(
            attention,
            dim,
            num_heads,
            attn_head_dim=head_dim,
            qkv_bias=True,
            attn_drop=attn_dropout,
            proj_drop=dropout,
        )
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attn_mask=mask)
        return x + self.mlp(self.norm2(x))


def sinusoidal(length: int, dim: int) -> torch.Tensor:
    """The fixed sine/cosine position table of Vaswani et al. (2017), (length, dim)."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10_000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table.float()


class Encoder(nn.Module):
    """Token embedding + positions (+ CLS) -> pre-norm blocks -> final norm -> pooled (B, dim)."""

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        mlp_dim: int = 128,
        head_dim: int | None = None,
        attention: registry.Config = "sdpa",
        pooling: str = "mean",
        positions: str = "learned",
        dropout: float = 0.1,
        attn_dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if pooling not in ("cls", "mean", "none"):
            raise ValueError(f"pooling must be 'cls', 'mean' or 'none' (per-token outputs), got {pooling!r}")
        if positions not in ("learned", "sinusoidal", "none"):
            raise ValueError(f"positions must be 'learned', 'sinusoidal' or 'none', got {positions!r}")
        if vocab_size < 2 or max_length < 1 or depth < 1:
            raise ValueError(
                f"need vocab_size >= 2, max_length >= 1, depth >= 1; got {vocab_size}, {max_length}, {depth}"
            )
        self.pooling, self.max_length = pooling, max_length
        prefix = int(pooling == "cls")
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim)) if prefix else None
        if positions == "learned":
            self.pos = nn.Parameter(torch.randn(1, max_length + prefix, dim) * 0.02)
        elif positions == "none":
            self.pos = None
        else:
            self.register_buffer("pos", sinusoidal(max_length + prefix, dim)[None], persistent=False)
        self.drop = nn.Dropout(dropout)
        attention = _prefix_option(attention, prefix)
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, mlp_dim, attention, head_dim, dropout, attn_dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (B, N) ids, 0 = padding, or (B, N, C) channels of ids (embeddings summed),
        N <= max_length; returns (B, dim), or (B, N, dim) with ``pooling="none"``."""
        B, N = tokens.shape[:2]
        if self.max_length < N:
            raise ValueError(f"sequence length {N} exceeds the model's max_length {self.max_length}")
        tokens = tokens.long()
        real = (tokens if tokens.dim() == 2 else tokens[..., 0]) != 0
        x = self.embed(tokens)
        if tokens.dim() == 3:
            x = x.sum(2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(B, -1, -1), x], dim=1)
            real = torch.cat([real.new_ones(B, 1), real], dim=1)
        x = self.drop(x if self.pos is None else x + self.pos[:, : x.shape[1]])
        mask = None if bool(real.all()) else real
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        if self.pooling == "none":
            return x
        if self.cls is not None:
            return x[:, 0]
        weights = real.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class Classifier(nn.Module):
    """LRA classifier: encoder, then an MLP head. ``dual=True``: Retrieval's two-tower model whose
    head reads [e1, e2, e1 * e2, e1 - e2] (Tay et al. 2021)."""

    def __init__(self, num_classes: int, dual: bool = False, **encoder: Any) -> None:
        super().__init__()
        self.dual = dual
        self.encoder = Encoder(**encoder)
        dim = self.encoder.norm.normalized_shape[0]
        width = 4 * dim if dual else dim
        self.head = nn.Sequential(nn.Linear(width, dim), nn.GELU(), nn.Linear(dim, num_classes))

    def forward(self, tokens: torch.Tensor, tokens2: torch.Tensor | None = None) -> torch.Tensor:
        if self.dual != (tokens2 is not None):
            raise ValueError("a dual (Retrieval) model needs tokens2; a single model takes none")
        if not self.dual:
            return self.head(self.encoder(tokens))
        e1, e2 = self.encoder(tokens), self.encoder(tokens2)
        return self.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))


def set_attention_options(model: nn.Module, **options: Any) -> int:
    """Change call-time options (e.g. MiTA's num_landmarks, topk, num_routed) on every attention layer.

    Returns the number of layers changed; an option no layer has raises a ValueError.
    """
    from mita.layers.base import AttentionLayer

    changed = 0
    for layer in model.modules():
        if not isinstance(layer, AttentionLayer):
            continue
        store = layer.options if isinstance(getattr(layer, "options", None), dict) else None
        accepted = inspect.signature(layer.op).parameters if store is not None else {}
        for key, value in options.items():
            if store is not None and key in accepted:
                store[key] = value
            elif hasattr(layer, key):
                setattr(layer, key, value)
            else:
                raise ValueError(f"{type(layer).__name__} has no option {key!r}")
        changed += 1
    if not changed:
        raise ValueError("the model has no attention layer to change")
    return changed
