"""The registry's records: :class:`Method`, :class:`Taxonomy` and :func:`register`.

A leaf module (it imports no other part of mita): :mod:`mita.registrations` fills it with
the library's ops and layers, and :mod:`mita.attention` looks methods up in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Taxonomy:
    """The five dimensions of the paper's taxonomy (spec section 5)."""

    scaling: str  # routing, compression, compression + routing (or none)
    expert_count: str  # 1, m, N/n, N
    expert_type: str  # linear, MLP (softmax), arbitrary
    construction: str  # content-dependent (how) or position-driven (how)
    topology: str  # all-to-one, N-to-m, N-to-N/n, N times one-to-one, ...

    FIELDS = ("scaling", "expert_count", "expert_type", "construction", "topology")


@dataclass(frozen=True)
class Method:
    """One attention method: its op, its layer, its place in the taxonomy and its cost."""

    name: str
    taxonomy: Taxonomy
    op: Callable[..., torch.Tensor] | None = None  # op(q, k, v, *, key_padding_mask=None, dropout_p=0., **options)
    layer: type | None = None  # an AttentionLayer subclass; default: OpAttention over ``op``
    defaults: Mapping[str, Any] = field(default_factory=dict)
    flops: Callable[..., float] | None = None  # per head and batch element: flops(n, d, **options)
    cost: str = ""  # the cost formula in words, e.g. "4 N^2 D"
    paper: str = ""

    @property
    def implemented(self) -> bool:
        return self.op is not None


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method to the registry (its name must be new)."""
    if method.name in REGISTRY:
        raise ValueError(f"attention method {method.name!r} is registered already")
    REGISTRY[method.name] = method
    return method
