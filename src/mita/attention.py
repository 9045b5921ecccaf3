"""The registry of attention methods: build any op or layer by name, and the paper's taxonomy.

Models, the benchmark suite and the command line find methods only through this module.
Adding a method means adding one file under ``mita/ops/`` that calls :func:`register`,
and naming that module in ``_BUILTIN_MODULES``.

A config is a name with options, as a string ``"mita:num_landmarks=64,topk=64"`` or a
dict ``{"name": "mita", "num_landmarks": 64, "topk": 64}``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .layers.base import AttentionLayer

_BUILTIN_MODULES = [
    "mita.ops.sdpa",
    "mita.ops.mita.registration",
    "mita.ops.topk",
    "mita.ops.moba",
    "mita.ops.linear",
    "mita.ops.agent",
    "mita.ops.nystrom",
    "mita.ops.taxonomy_only",
]
_REGISTRY: dict[str, Method] = {}

Config = str | Mapping[str, Any]


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
    layer: type[AttentionLayer] | None = None  # default: OpAttention over ``op``
    defaults: Mapping[str, Any] = field(default_factory=dict)
    flops: Callable[..., float] | None = None  # per head and batch element: flops(n, d, **options)
    cost: str = ""  # the cost formula in words, e.g. "4 N^2 D"
    paper: str = ""

    @property
    def implemented(self) -> bool:
        return self.op is not None


def register(method: Method) -> Method:
    """Add a method to the registry (its name must be new)."""
    if method.name in _REGISTRY:
        raise ValueError(f"attention method {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    return method


@functools.cache
def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def methods(implemented: bool = True) -> list[Method]:
    """Registered methods in registration order (with ``implemented=False`` also the taxonomy-only rows)."""
    _load_builtins()
    return [m for m in _REGISTRY.values() if m.implemented or not implemented]


def names(implemented: bool = True) -> list[str]:
    return [m.name for m in methods(implemented)]


def get(name: str) -> Method:
    """The method called ``name``; a ValueError lists the valid names otherwise."""
    _load_builtins()
    method = _REGISTRY.get(name)
    if method is None or not method.implemented:
        why = "is listed in the taxonomy but not implemented" if method else "is not a registered attention"
        raise ValueError(f"attention {name!r} {why}; valid names: {', '.join(names())}")
    return method


def parse(config: Config) -> tuple[str, dict[str, Any]]:
    """Split a config string or dict into (name, options)."""
    if isinstance(config, Mapping):
        options = dict(config)
        if "name" not in options:
            raise ValueError(f"an attention config dict needs a 'name' key, got {sorted(options)}")
        return str(options.pop("name")), options
    if not isinstance(config, str) or not config:
        raise ValueError(f"an attention config is a name like 'mita:topk=32' or a dict, got {config!r}")
    name, _, rest = config.partition(":")
    options = {}
    for item in filter(None, (p.strip() for p in re.split(r",(?![^(\[]*[)\]])", rest))):  # not inside (..) / [..]
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"attention option {item!r} in {config!r} must read key=value")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return name.strip(), options


def resolve(config: Config) -> tuple[Method, dict[str, Any]]:
    """The method of a config and its options merged over the method's defaults."""
    name, options = parse(config)
    method = get(name)
    return method, {**method.defaults, **options}


def build_op(config: Config) -> Callable[..., torch.Tensor]:
    """``op(q, k, v, key_padding_mask=None, dropout_p=0.)`` with the config's options bound."""
    method, options = resolve(config)
    return functools.partial(method.op, **options)


def build_layer(config: Config, dim: int, num_heads: int = 8, **layer_kwargs: Any) -> AttentionLayer:
    """A timm-compatible attention layer of the configured method."""
    method, options = resolve(config)
    if method.layer is not None:
        return method.layer(dim, num_heads, **layer_kwargs, **options)
    return OpAttention(dim, num_heads, **layer_kwargs, attention=method.name, **options)


def flops(config: Config, n: int, d: int) -> float | None:
    """Per-head FLOPs of the configured method at sequence length n, head dim d (spec section 3)."""
    method, options = resolve(config)
    return None if method.flops is None else float(method.flops(n, d, **options))


class OpAttention(AttentionLayer):
    """A timm-compatible layer around any registered op; ``options`` can be changed after building."""

    def __init__(self, dim: int, num_heads: int = 8, *args: Any, attention: str, **kwargs: Any) -> None:
        base = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAYER_ARGS}
        super().__init__(dim, num_heads, *args, **base)
        self.attention, self.options = attention, kwargs
        self.op = get(attention).op

    def extra_repr(self) -> str:
        return f"attention={self.attention!r}, options={self.options}"

    def attend(self, q, k, v, key_padding_mask, is_causal):
        extra = {"is_causal": True} if is_causal else {}
        return self.op(q, k, v, key_padding_mask=key_padding_mask, dropout_p=self.dropout_p, **extra, **self.options)

    @property
    def supports_causal(self) -> bool:  # type: ignore[override]
        """Whether the op takes ``is_causal`` (SDPA, top-k, MoBA, linear attention)."""
        return "is_causal" in inspect.signature(self.op).parameters


_LAYER_ARGS = set(AttentionLayer.__init__.__code__.co_varnames[3 : AttentionLayer.__init__.__code__.co_argcount])


def taxonomy_table(fmt: str = "markdown") -> str:
    """The paper's taxonomy of every registered method (implemented or not) as markdown or CSV."""
    header = ["method", "implemented", *Taxonomy.FIELDS, "cost per head (FLOPs)", "paper"]
    rows = [
        [
            m.name, "yes" if m.implemented else "no", *(getattr(m.taxonomy, f) for f in Taxonomy.FIELDS),
            m.cost, m.paper,
        ]
        for m in methods(implemented=False)
    ]  # fmt: skip
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([header, *rows])
        return buf.getvalue()
    if fmt != "markdown":
        raise ValueError(f"fmt must be 'markdown' or 'csv', got {fmt!r}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)]) + "\n"
