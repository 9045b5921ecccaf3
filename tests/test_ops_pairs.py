"""The checks every op of issue 28 shares, from one table: its efficient path against its readable reference
(outputs and gradients, float64, GQA, masks, cross-attention), padded slots holding NaN or inf that take no
part, a padded sequence equal to the truncated one, and float64 gradcheck, on both paths. Each method's own
closed forms, errors and layer are in ``test_ops_<method>.py``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from _pairs import (
    Options,
    assert_gradcheck,
    assert_masked_equals_truncated,
    assert_paths_agree,
    no_options,
    padding_cases,
    paths_agree_cases,
)
from _zoo import F64
from mita.ops.flatten import focused_linear_attention, focused_linear_attention_reference
from mita.ops.inline import inline_attention, inline_attention_reference
from mita.ops.mhla import mhla_attention, mhla_attention_reference
from mita.ops.nsa import nsa_attention, nsa_attention_reference
from mita.ops.polaformer import polarity_linear_attention, polarity_linear_attention_reference
from mita.ops.ttt import ttt_linear_attention, ttt_linear_attention_reference
from mita.ops.ttt_mlp import ttt_mlp_attention, ttt_mlp_attention_reference
from test_ops_nsa import SMALL
from test_ops_padding import _check_padding_is_inert


@dataclass(frozen=True)
class Pair:
    """A method's two paths and the options each shared check runs them with.

    Args:
        fast (callable): the efficient op.
        reference (callable): its reference.
        agree (dict): id -> the options (a function of H, Hkv, Nq, D) the paths are compared with.
        padded (dict): the options of the padding check.
        truncated (tuple): the options of each masked-equals-truncated check. Default: ``({},)``.
        gradcheck (callable): the options of gradcheck. Default: none.
        fast_options (dict): options of the efficient path in the comparison only (a small chunk). Default: none.
        tolerance (tuple): (rtol, atol) of the comparison. Default: (1e-10, 1e-12).
    """

    fast: Callable
    reference: Callable
    agree: dict[str, Options]
    padded: dict
    truncated: tuple[dict, ...] = ({},)
    gradcheck: Options = no_options
    fast_options: dict = field(default_factory=dict)
    tolerance: tuple[float, float] = (1e-10, 1e-12)


def flatten_learned(H: int, Hkv: int, Nq: int, D: int) -> dict:
    """A learned per-(kv head, channel) scale and a fractional focusing factor."""
    return {"feature_scale": (0.5 + torch.rand(Hkv, D, dtype=F64)).requires_grad_(), "focusing_factor": 2.5}


def inline_scaled(H: int, Hkv: int, Nq: int, D: int) -> dict:
    return {"scale": 0.3}


def pola_learned(H: int, Hkv: int, Nq: int, D: int) -> dict:
    """A learned per-(kv head, channel) exponent in [1, 5) and scale."""
    return {
        "power": (1 + 4 * torch.rand(Hkv, D, dtype=F64)).requires_grad_(),
        "feature_scale": (0.5 + torch.rand(Hkv, D, dtype=F64)).requires_grad_(),
    }


def ttt_mini_batches(H: int, Hkv: int, Nq: int, D: int) -> dict:
    """A learned initial model, mini-batches of 4 keys, a small learning rate (several stable steps)."""
    w0 = (0.1 * torch.randn(Hkv, D, D, dtype=F64)).requires_grad_()
    return {"initial_weight": w0, "mini_batch_size": 4, "inner_lr": 0.05}


def ttt_mlp_learned(H: int, Hkv: int, Nq: int, D: int) -> dict:
    """A learned initial MLP of hidden width 4 D, mini-batches of 4 keys (several steps)."""
    w1 = (0.5 * torch.randn(Hkv, D, 4 * D, dtype=F64)).requires_grad_()
    w2 = (0.5 * torch.randn(Hkv, 4 * D, D, dtype=F64)).requires_grad_()
    return {"weight1": w1, "weight2": w2, "mini_batch_size": 4, "inner_lr": 0.3}


def mhla_blocks(H: int, Hkv: int, Nq: int, D: int) -> dict:
    return {"num_blocks": 3}


def mhla_learned(H: int, Hkv: int, Nq: int, D: int) -> dict:
    """A learned mixing of 4 blocks and a prefix token."""
    return {
        "num_blocks": 4,
        "num_prefix_tokens": 1 if Nq > 1 else 0,
        "mixing": torch.rand(4, 4, dtype=F64).requires_grad_(),
    }


def mhla_gradcheck(H: int, Hkv: int, Nq: int, D: int) -> dict:
    return {"num_blocks": 2, "mixing": torch.rand(2, 2, dtype=F64).requires_grad_()}


def nsa_small(H: int, Hkv: int, Nq: int, D: int) -> dict:
    return dict(SMALL)


def nsa_gated(H: int, Hkv: int, Nq: int, D: int) -> dict:
    """Odd blocks, one selected, the own position only, learned gates."""
    return {"block_size": 5, "topk": 1, "window": 0, "gates": torch.rand(2, H, Nq, 3, dtype=F64).requires_grad_()}


PAIRS = {
    "flatten": Pair(
        focused_linear_attention,
        focused_linear_attention_reference,
        {"defaults": no_options, "learned-scale": flatten_learned},
        {"feature_scale": torch.full((8,), 0.7, dtype=F64)},
        gradcheck=flatten_learned,
    ),
    "inline": Pair(
        inline_attention,
        inline_attention_reference,
        {"defaults": no_options, "scale": inline_scaled},
        {},
        gradcheck=inline_scaled,
    ),
    "pola": Pair(
        polarity_linear_attention,
        polarity_linear_attention_reference,
        {"defaults": no_options, "learned": pola_learned},
        {"power": torch.full((8,), 2.5, dtype=F64)},
        gradcheck=pola_learned,
    ),
    "ttt_linear": Pair(  # the dual form against the explicit inner loop
        ttt_linear_attention,
        ttt_linear_attention_reference,
        {"full-batch": no_options, "mini-batches": ttt_mini_batches},
        {"mini_batch_size": 5, "inner_lr": 0.1, "initial_weight": 0.1 * torch.eye(8, dtype=F64)},
        truncated=({}, {"mini_batch_size": 7, "inner_lr": 0.1}),
        gradcheck=ttt_mini_batches,
        tolerance=(1e-9, 1e-11),
    ),
    "ttt_mlp": Pair(  # the inner gradient written out against torch.autograd.grad
        ttt_mlp_attention,
        ttt_mlp_attention_reference,
        {"full-batch": no_options, "mini-batches": ttt_mlp_learned},
        {"mini_batch_size": 5, "inner_lr": 0.5},
        truncated=({}, {"mini_batch_size": 7}),
        gradcheck=ttt_mlp_learned,
        tolerance=(1e-9, 1e-11),
    ),
    "mhla": Pair(
        mhla_attention,
        mhla_attention_reference,
        {"cosine": mhla_blocks, "learned-prefix": mhla_learned},
        {"num_blocks": 4, "num_prefix_tokens": 2},
        truncated=({"num_blocks": 5},),
        gradcheck=mhla_gradcheck,
        tolerance=(1e-10, 1e-11),
    ),
    "nsa": Pair(
        nsa_attention,
        nsa_attention_reference,
        {"small": nsa_small, "gated": nsa_gated},
        SMALL,
        truncated=(SMALL,),
        gradcheck=nsa_gated,
        fast_options={"chunk_size": 3},
    ),
}
#: (method, options) of every comparison
AGREE = [
    pytest.param(name, options, id=f"{name}-{key}")
    for name, pair in PAIRS.items()
    for key, options in pair.agree.items()
]
#: (method, op): both paths of every method
PATHS = [
    pytest.param(name, op, id=f"{name}-{path}")
    for name, pair in PAIRS.items()
    for path, op in (("fast", pair.fast), ("ref", pair.reference))
]


@pytest.mark.parametrize(("nq", "nk", "groups", "masked"), paths_agree_cases())
@pytest.mark.parametrize(("name", "options"), AGREE)
def test_efficient_matches_reference(name, options, nq, nk, groups, masked):
    pair = PAIRS[name]
    fast = functools.partial(pair.fast, **pair.fast_options)
    assert_paths_agree(fast, pair.reference, options, nq, nk, groups, masked, *pair.tolerance)


@pytest.mark.parametrize(("tensor", "fill", "hkv", "nq", "nk"), padding_cases())
@pytest.mark.parametrize(("name", "op"), PATHS)
def test_padded_slots_take_no_part(name, op, tensor, fill, hkv, nq, nk):
    _check_padding_is_inert(op, tensor, fill, hkv, nq, nk, PAIRS[name].padded)


@pytest.mark.parametrize(("name", "op"), PATHS)
def test_masked_sequence_equals_the_truncated_sequence(name, op):
    for options in PAIRS[name].truncated:
        assert_masked_equals_truncated(op, options)


@pytest.mark.parametrize(("name", "op"), PATHS)
def test_gradcheck(name, op):
    assert_gradcheck(op, PAIRS[name].gradcheck)


def test_every_op_with_a_reference_is_checked() -> None:
    """Every registered op with a ``<op>_reference`` beside it is in this table or in ``test_ops.PAIRS``
    (MiTA aside: its paths have files of their own), so that a new method does not skip the shared checks."""
    import importlib

    from mita import attention as registry
    from test_ops import PAIRS as OLDER

    ops = {registry.get(name).op for name in registry.names()} - {registry.get("mita").op}
    with_reference = {op for op in ops if hasattr(importlib.import_module(op.__module__), f"{op.__name__}_reference")}
    checked = {pair.fast for pair in PAIRS.values()} | {fast for fast, _, _ in OLDER.values()}
    assert with_reference == checked
