"""Bidirectional TTT-MLP (issue 28): the closed forms (zero learning rate, one step against a finite-difference
gradient, token-by-token steps), errors, the layer. The written-out step against the autograd one, padding and
gradcheck: ``test_ops_pairs.py``."""

from __future__ import annotations

import math

import pytest
import torch

from _pairs import assert_layer_extras
from _zoo import F64, padding, qkv
from mita import attention as registry
from mita.ops.ttt_mlp import default_inner_mlp, ttt_mlp_attention, ttt_mlp_attention_reference

PATHS = [ttt_mlp_attention, ttt_mlp_attention_reference]


def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x + LN(GELU(x W1) W2) written out: erf GELU, LN over the last dim without affine, eps 1e-6."""
    y = (0.5 * (x @ w1) * (1 + torch.erf(x @ w1 / math.sqrt(2)))) @ w2
    centred = y - y.mean(-1, keepdim=True)
    return x + centred / (centred.square().mean(-1, keepdim=True) + 1e-6).sqrt()


def numeric_step(w1, w2, k, v, lr):
    """W - lr grad of the mean of 1/2 ||f(k_j) - v_j||^2 over the rows of k, the gradient by central differences."""

    def loss(a, b):
        return 0.5 * (mlp(k, a, b) - v).square().sum() / k.shape[0]

    grads = []
    for w in (w1, w2):
        g = torch.zeros_like(w)
        for idx in torch.cartesian_prod(*(torch.arange(s) for s in w.shape)):
            idx = tuple(idx.tolist())
            plus, minus = w.clone(), w.clone()
            plus[idx] += 1e-6
            minus[idx] -= 1e-6
            args = [(plus, minus) if x is w else (x, x) for x in (w1, w2)]
            g[idx] = (loss(args[0][0], args[1][0]) - loss(args[0][1], args[1][1])) / 2e-6
        grads.append(g)
    return w1 - lr * grads[0], w2 - lr * grads[1]


def weights(Hkv: int, D: int, h: int, std: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    return std * torch.randn(Hkv, D, h, dtype=F64), std * torch.randn(Hkv, h, D, dtype=F64)


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_zero_learning_rate_reads_the_initial_model(op):
    """inner_lr = 0: out = q + LN(GELU(q W1) W2) with the kv head's W1, W2 (GQA: query heads 0, 1 share kv head 0)."""
    q, k, v = qkv(Nq=9, Nk=12)
    w1, w2 = weights(2, 8, 12)
    out = op(q, k, v, inner_lr=0.0, weight1=w1, weight2=w2, mini_batch_size=5)
    torch.testing.assert_close(out, mlp(q, w1.repeat_interleave(2, dim=0), w2.repeat_interleave(2, dim=0)))


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_zero_learning_rate_default_model_is_the_fixed_draw(op):
    q, k, v = qkv(Nq=5, Nk=5)
    w1, w2 = default_inner_mlp(8, 32, q)
    torch.testing.assert_close(op(q, k, v, inner_lr=0.0), mlp(q, w1[0], w2[0]))


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_one_step_is_the_finite_difference_gradient_step(op):
    """One full-batch step over the 3 real keys of 4 (the padded one takes no part), then q through the model."""
    q, k, v = qkv(B=1, H=2, Hkv=1, Nq=3, Nk=4, D=2)
    w1, w2 = weights(1, 2, 3)
    mask = padding(1, 4, [3])
    new1, new2 = numeric_step(w1[0], w2[0], k[0, 0, :3], v[0, 0, :3], 0.4)
    out = op(q, k, v, inner_lr=0.4, weight1=w1, weight2=w2, key_padding_mask=mask, query_padding_mask=mask[:, :3])
    torch.testing.assert_close(out, mlp(q, new1, new2), rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_one_token_mini_batches_step_key_by_key(op):
    """mini_batch_size = 1: one step per key, in order."""
    q, k, v = qkv(B=1, H=1, Hkv=1, Nq=2, Nk=3, D=2)
    w1, w2 = weights(1, 2, 4)
    want1, want2 = w1[0], w2[0]
    for j in range(3):
        want1, want2 = numeric_step(want1, want2, k[0, 0, j : j + 1], v[0, 0, j : j + 1], 0.3)
    out = op(q, k, v, inner_lr=0.3, mini_batch_size=1, weight1=w1, weight2=w2)
    torch.testing.assert_close(out, mlp(q, want1, want2), rtol=1e-7, atol=1e-8)


def test_a_small_step_lowers_the_reconstruction_loss():
    """The step descends: the inner loss over the keys after it is below the loss before (small learning rate)."""
    _, k, v = qkv(B=1, H=1, Hkv=1, Nq=1, Nk=20)
    w1, w2 = weights(1, 8, 32)
    after = ttt_mlp_attention(k, k, v, inner_lr=0.01, weight1=w1, weight2=w2)  # the keys as queries: f_1(k)
    before = mlp(k, w1[0], w2[0])
    assert (after - v).square().sum() < (before - v).square().sum()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        # (the options shared with TTT-Linear: test_ops_ttt.py)
        ({"weight1": torch.zeros(2, 8, 32, dtype=F64)}, ValueError, "weight1 and weight2 must be given together"),
        ({"weight1": 1.0, "weight2": 1.0}, TypeError, "weight1 must be a float tensor"),
        (
            {"weight1": torch.zeros(3, 8, 32, dtype=F64), "weight2": torch.zeros(3, 32, 8, dtype=F64)},
            ValueError,
            r"weight1 of shape \(3, 8, 32\) must broadcast to \(Hkv=2, D=8, h=32\)",
        ),
        (
            {"weight1": torch.zeros(8, 32, dtype=F64), "weight2": torch.zeros(16, 8, dtype=F64)},
            ValueError,
            r"weight2 of shape \(16, 8\) must broadcast to \(Hkv=2, h=32, D=8\)",
        ),
        (
            {"weight1": torch.zeros(8, 32, dtype=torch.long), "weight2": torch.zeros(32, 8, dtype=F64)},
            TypeError,
            "weight1 must be a float tensor",
        ),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        ttt_mlp_attention(q, k, v, **options)


def test_layer_learns_its_initial_model():
    layer = registry.build_layer("ttt_mlp", 32, 4)
    assert layer.inner.weight1.shape == (4, 8, 32) and layer.inner.weight2.shape == (4, 32, 8)
    assert layer.inner_lr == 0.1 and layer.mini_batch_size is None
    x = torch.randn(2, 17, 32)
    out = layer(x, attn_mask=padding(2, 17, [17, 12]))
    out.square().sum().backward()
    assert layer.inner.weight1.grad.abs().sum() > 0 and layer.inner.weight2.grad.abs().sum() > 0
    assert (out[1, 12:] == layer.proj.bias).all()


def test_layer_adds_only_its_initial_model():
    assert_layer_extras("ttt_mlp", {}, {"inner"})
