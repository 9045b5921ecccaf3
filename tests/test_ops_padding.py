"""Padded slots take no part: whatever a padded query, key or value holds (NaN, inf, 1e30), every op's
real outputs and gradients equal those with zeros there (issue 25, item 3)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from _zoo import CAUSAL, F64, IMPLEMENTED, _small, qkv
from mita import attention as registry
from mita.ops.pooling import check_pooling, pool, pool_reference

FILLS = [float("nan"), float("inf"), float("-inf"), 1e30]
# (name, Nq, Nk, causal): self-attention (the key mask marks the queries too) and cross-attention.
KINDS = [("self", 33, 33, False), ("self-causal", 33, 33, True), ("cross", 23, 41, False)]
# Options that let a query select more keys (or blocks) than are real: padded slots get picked, with weight 0.
WIDE = {"mita": {"topk": 64}, "mita_routed": {"topk": 64}, "topk": {"topk": 64}, "moba": {"topk": 64}}

CASES = [
    pytest.param(name, tensor, fill, hkv, kind, id=f"{name}-{tensor}-{fill:g}-hkv{hkv}-{kind[0]}")
    for name in IMPLEMENTED
    for kind in KINDS
    if not kind[3] or name in CAUSAL
    for hkv in (4, 2)
    for tensor in ("q", "k", "v")
    for fill in FILLS
]


def _mask(n: int, padded: list[list[int]]) -> torch.Tensor:
    """Bool (B, n) mask, True = real, with the positions listed per batch element padded."""
    mask = torch.ones(len(padded), n, dtype=torch.bool)
    for b, positions in enumerate(padded):
        mask[b, positions] = False
    return mask


def _masks(nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Query and key masks with gaps at the start, inside and at the end, and the op's mask arguments.

    Causal, the first (padded) query of batch element 1 sees no real key at all.
    """
    key_mask = _mask(nk, [[3, 4, 9, nk - 1], [0, 1, *range(nk - 7, nk)]])
    if nq == nk:  # self-attention: the key mask marks the queries
        return key_mask, key_mask, {"key_padding_mask": key_mask}
    query_mask = _mask(nq, [[2, 11], list(range(nq - 5, nq))])
    return query_mask, key_mask, {"key_padding_mask": key_mask, "query_padding_mask": query_mask}


def _run(
    op: Callable, inputs: dict[str, torch.Tensor], weight: torch.Tensor, options: dict
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The output and the gradients of (weight * output).sum() wrt q, k and v."""
    leaves = [inputs[n].detach().requires_grad_() for n in "qkv"]
    out = op(*leaves, **options)
    return out.detach(), torch.autograd.grad((weight * out).sum(), leaves)


def _check_padding_is_inert(op: Callable, tensor: str, fill: float, hkv: int, nq: int, nk: int, options: dict) -> None:
    """``fill`` in the padded slots of ``tensor`` (the others hold random values there) against zeros:
    equal outputs and gradients, all finite, zero output rows for padded queries, zero gradient for
    every padded slot."""
    clean = dict(zip("qkv", qkv(B=2, H=4, Hkv=hkv, Nq=nq, Nk=nk, D=8)))
    query_mask, key_mask, masks = _masks(nq, nk)
    pads = {"q": ~query_mask[:, None, :, None], "k": ~key_mask[:, None, :, None], "v": ~key_mask[:, None, :, None]}
    weight = torch.randn(2, 4, nq, 8, dtype=F64)
    clean[tensor] = clean[tensor].masked_fill(pads[tensor], 0)
    dirty = {**clean, tensor: clean[tensor].masked_fill(pads[tensor], fill)}
    out, grads = _run(op, dirty, weight, {**masks, **options})
    want, want_grads = _run(op, clean, weight, {**masks, **options})
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert (out.masked_select(pads["q"]) == 0).all(), "padded queries' output rows are zero"
    for name, got, expected in zip("qkv", grads, want_grads):
        assert torch.isfinite(got).all(), f"grad {name}"
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m, name=name: f"grad {name}: {m}")
        assert (got.masked_select(pads[name]) == 0).all(), f"padded slots of {name} get zero gradient"


@pytest.mark.parametrize(("name", "tensor", "fill", "hkv", "kind"), CASES)
def test_padded_slots_take_no_part(name, tensor, fill, hkv, kind):
    """Every registered method, each of q, k, v, with and without GQA, self-, causal and cross-attention."""
    _, nq, nk, causal = kind
    op = registry.build_op({"name": name, **_small(name)})
    _check_padding_is_inert(op, tensor, fill, hkv, nq, nk, {"is_causal": True} if causal else {})


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("name", list(WIDE))
def test_padded_slots_take_no_part_when_every_key_is_selectable(name, tensor):
    """More keys or blocks selected than are real: a padded slot may be picked, with zero weight."""
    op = registry.build_op({"name": name, **_small(name), **WIDE[name]})
    _check_padding_is_inert(op, tensor, float("nan"), 2, 33, 33, {})


@pytest.mark.parametrize("kind", [k for k in KINDS if not k[3]], ids=lambda k: k[0])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("impl", ["fused", "grouped", "reference"])
def test_padded_slots_take_no_part_in_every_mita_path(impl, tensor, kind):
    """The registry's "mita" takes one path (fused on CPU); the others must agree on padding too."""
    op = registry.build_op({"name": "mita", **_small("mita"), "impl": impl})
    _check_padding_is_inert(op, tensor, float("nan"), 2, kind[1], kind[2], {})


@pytest.mark.parametrize("fill", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("pool_fn", [pool, pool_reference], ids=["pool", "pool_reference"])
@pytest.mark.parametrize(
    ("num", "grid", "prefix", "n"),
    [(4, None, 0, 20), (4, (4, 4), 1, 17), (8, (2, 3, 3), 0, 18)],
    ids=["1d", "2d", "3d"],
)
def test_pooling_ignores_what_padded_tokens_hold(num, grid, prefix, n, pool_fn, fill):
    """Landmarks and agents average the real tokens: a padded token's value reaches neither them nor a gradient."""
    pooling = check_pooling(num, grid, prefix, n)
    mask = _mask(n, [[prefix, n - 1], [prefix + 5]])
    x = torch.randn(2, 3, n, 5, dtype=F64).masked_fill(~mask[:, None, :, None], 0)
    clean, dirty = (t.requires_grad_() for t in (x.clone(), x.masked_fill(~mask[:, None, :, None], fill)))
    out, want = pool_fn(dirty, pooling, mask), pool_fn(clean, pooling, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), dirty)
    torch.testing.assert_close(grad, torch.autograd.grad(want.sum(), clean)[0], rtol=0, atol=0)
    assert (grad.masked_select(~mask[:, None, :, None]) == 0).all()
