"""The registry of attention methods: build any op or layer by name, and the paper's taxonomy.

Models, the benchmark suite and the command line find methods only through this module.
The methods themselves are registered in :mod:`mita.registrations` (adding one: write its
op under ``mita/ops/``, then one ``register`` call there).

A config is a name with options, as a string ``"mita:num_landmarks=64,topk=64"`` or a
dict ``{"name": "mita", "num_landmarks": 64, "topk": 64}``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import registrations as _registrations  # noqa: F401  (fills the registry)
from .layers.base import AttentionLayer
from .layers.op import LAYER_ARGS, OpAttention, op_options
from .registry import REGISTRY, Method, Taxonomy, register
from .utils.options import parse_config

__all__ = [
    "Config",
    "Method",
    "OpAttention",
    "Taxonomy",
    "build_layer",
    "build_op",
    "flops",
    "get",
    "layer_options",
    "methods",
    "names",
    "parse",
    "register",
    "resolve",
    "taxonomy_table",
]

Config = str | Mapping[str, Any]


def methods(implemented: bool = True) -> list[Method]:
    """Registered methods in registration order (with ``implemented=False`` also the taxonomy-only rows)."""
    return [m for m in REGISTRY.values() if m.implemented or not implemented]


def names(implemented: bool = True) -> list[str]:
    """The names of :func:`methods`."""
    return [m.name for m in methods(implemented)]


def get(name: str) -> Method:
    """The method called ``name``; a ValueError lists the valid names otherwise."""
    method = REGISTRY.get(name)
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
    return parse_config(config, "attention")


def resolve(config: Config) -> tuple[Method, dict[str, Any]]:
    """The method of a config and its options merged over the method's defaults."""
    name, options = parse(config)
    method = get(name)
    return method, {**method.defaults, **options}


def build_op(config: Config) -> Callable[..., torch.Tensor]:
    """``op(q, k, v, key_padding_mask=None, dropout_p=0.)`` with the config's options bound."""
    method, options = resolve(config)
    return functools.partial(method.op, **options)


def layer_options(method: Method, layer: type[AttentionLayer] | None = None) -> list[str]:
    """The options a layer of ``method`` takes besides timm's ``Attention`` arguments, sorted.

    Those of its own layer class (``layer``, else ``method.layer``: every keyword its
    constructors add to :class:`AttentionLayer`'s), or for an :class:`OpAttention` the op's.
    """
    layer = layer or method.layer
    if layer is None:
        return op_options(method.op)
    names = set()
    for cls in layer.__mro__[: layer.__mro__.index(AttentionLayer)]:
        if "__init__" in vars(cls):
            params = inspect.signature(cls.__init__).parameters.values()
            names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    return sorted(names)


def build_layer(config: Config, dim: int, num_heads: int = 8, **layer_kwargs: Any) -> AttentionLayer:
    """A timm-compatible attention layer of the configured method.

    ``layer_kwargs`` are timm's ``Attention`` arguments (``qkv_bias``, ``attn_drop``, ...) and
    options of the method not in ``config``; an option the layer does not take is a ValueError
    that lists the ones it takes.
    """
    name, given = parse(config)
    method = get(name)
    accepted = layer_options(method)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"attention {name!r} takes no options {unknown}; its options: {accepted}")
    unknown = sorted(set(layer_kwargs) - set(accepted) - LAYER_ARGS)
    if unknown:
        timm_args = sorted(LAYER_ARGS - {"dim", "num_heads"})
        raise ValueError(
            f"build_layer({name!r}) takes no keyword arguments {unknown}; it takes the method's options "
            f"{accepted} and timm's Attention arguments {timm_args}"
        )
    twice = sorted(set(given) & set(layer_kwargs))
    if twice:
        raise ValueError(f"options {twice} are given both in the config and as keyword arguments; give them once")
    options = {**method.defaults, **given, **layer_kwargs}
    if method.layer is not None:
        return method.layer(dim, num_heads, **options)
    return OpAttention(dim, num_heads, op=method.op, name=method.name, **options)


def flops(config: Config, n: int, d: int) -> float | None:
    """Per-head FLOPs of the configured method at sequence length n, head dim d (spec section 3)."""
    method, options = resolve(config)
    return None if method.flops is None else float(method.flops(n, d, **options))


def taxonomy_table(fmt: str = "markdown") -> str:
    """The paper's taxonomy of every registered method (implemented or not) as markdown or CSV."""
    header = ["method", "implemented", *Taxonomy.FIELDS, "cost per head (FLOPs)", "paper"]
    rows = [
        [m.name, "yes" if m.implemented else "no", *(getattr(m.taxonomy, f) for f in Taxonomy.FIELDS), m.cost, m.paper]
        for m in methods(implemented=False)
    ]
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
