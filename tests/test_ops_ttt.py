"""Bidirectional TTT-Linear (issue 28): the closed forms (zero learning rate, zero initial model, per-token
steps), errors, the layer. The dual form against the explicit inner loop, padding and gradcheck:
``test_ops_pairs.py``."""

from __future__ import annotations

import pytest
import torch

from _pairs import (
    assert_layer_extras,
)
from _zoo import F64, padding, qkv
from mita import attention as registry
from mita.ops.ttt import ttt_linear_attention, ttt_linear_attention_reference
from mita.ops.ttt_mlp import ttt_mlp_attention

PATHS = [ttt_linear_attention, ttt_linear_attention_reference]


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_zero_learning_rate_reads_the_initial_model(op):
    q, k, v = qkv(Nq=9, Nk=12)
    w0 = torch.randn(2, 8, 8, dtype=F64)
    out = op(q, k, v, inner_lr=0.0, initial_weight=w0, mini_batch_size=5)
    torch.testing.assert_close(out, q @ w0.repeat_interleave(2, dim=0))


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_one_step_from_zero_is_unnormalised_linear_attention(op):
    """W_1 = 0 - (lr / n) K^T (K 0 - V) = (lr / n) K^T V: out = (lr / n) Q K^T V over the n real keys."""
    q, k, v = qkv(Nq=9, Nk=12)
    mask = padding(2, 12, [12, 8])
    out = op(q, k, v, inner_lr=0.7, key_padding_mask=mask, query_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    keys, values = (t.masked_fill(~mask[:, None, :, None], 0).repeat_interleave(2, dim=1) for t in (k, v))
    n = mask.sum(1).to(F64)[:, None, None, None]
    torch.testing.assert_close(out, 0.7 / n * q @ keys.transpose(-1, -2) @ values)


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_one_token_mini_batches_are_the_delta_rule(op):
    """mini_batch_size = 1: W <- W - lr k^T (k W - v), key by key, in order."""
    q, k, v = qkv(B=1, H=2, Hkv=1, Nq=5, Nk=6)
    w = 0.1 * torch.randn(8, 8, dtype=F64)
    want = w.clone()
    for j in range(6):
        kj, vj = k[0, 0, j : j + 1], v[0, 0, j : j + 1]
        want = want - 0.05 * kj.T @ (kj @ want - vj)
    out = op(q, k, v, inner_lr=0.05, mini_batch_size=1, initial_weight=w)
    torch.testing.assert_close(out, q @ want)


SHARED_ERRORS = [
    ({"dropout_p": 0.1}, ValueError, "dropout_p"),
    ({"inner_lr": -0.1}, ValueError, "inner_lr must be a finite float >= 0"),
    ({"inner_lr": "big"}, TypeError, "inner_lr"),
    ({"mini_batch_size": 0}, ValueError, "mini_batch_size must be an int >= 1"),
]


@pytest.mark.parametrize("op", [ttt_linear_attention, ttt_mlp_attention], ids=["linear", "mlp"])
@pytest.mark.parametrize(("options", "error", "match"), SHARED_ERRORS)
def test_both_ttt_ops_name_their_shared_options(op, options, error, match):
    """The options TTT-Linear and TTT-MLP share (the op-specific ones: each op's own table)."""
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        op(q, k, v, **options)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"initial_weight": torch.zeros(3, 8, 8, dtype=F64)}, ValueError, "initial_weight of shape"),
        ({"initial_weight": torch.zeros(8, 8, dtype=torch.long)}, TypeError, "initial_weight"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        ttt_linear_attention(q, k, v, **options)


def test_layer_learns_its_initial_model():
    layer = registry.build_layer("ttt_linear", 32, 4)
    assert layer.inner.weight.shape == (4, 8, 8) and layer.inner_lr == 1.0 and layer.mini_batch_size is None
    x = torch.randn(2, 17, 32)
    mask = padding(2, 17, [17, 12])
    out = layer(x, attn_mask=mask)
    out.square().sum().backward()
    assert layer.inner.weight.grad.abs().sum() > 0
    assert (out[1, 12:] == layer.proj.bias).all()


def test_layer_adds_only_its_initial_model():
    assert_layer_extras("ttt_linear", {}, {"inner"})
