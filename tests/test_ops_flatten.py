"""FLatten's focused linear attention (issue 28): the focusing function written out, errors, the layer. Its
paths against each other, padding and gradcheck: ``test_ops_pairs.py``."""

from __future__ import annotations

import pytest
import torch

from _pairs import (
    assert_layer_extras,
)
from _zoo import F64, padding, qkv
from mita import attention as registry
from mita.layers import FLattenAttention
from mita.ops.flatten import focused_linear_attention


@pytest.mark.parametrize("p", [1.0, 3.0])
def test_focused_attention_written_out(p):
    """phi(x) = ||y|| y^p / ||y^p|| with y = (ReLU(x) + 1e-6) / s, then S V / (S 1 + 1e-6), S = phi(Q) phi(K)^T."""
    q, k, v = qkv(H=2, Hkv=2, Nq=9, Nk=11)
    s = 0.5 + torch.rand(2, 8, dtype=F64)

    def phi(x):
        y = (torch.relu(x) + 1e-6) / s[None, :, None, :]
        return y.norm(dim=-1, keepdim=True) * y**p / (y**p).norm(dim=-1, keepdim=True)

    S = phi(q) @ phi(k).transpose(-1, -2)
    want = S @ v / (S.sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(focused_linear_attention(q, k, v, focusing_factor=p, feature_scale=s), want)
    if p == 1.0:  # no focusing: linear attention with the ReLU kernel
        phi1 = (torch.relu(q) + 1e-6) / s[None, :, None, :], (torch.relu(k) + 1e-6) / s[None, :, None, :]
        S = phi1[0] @ phi1[1].transpose(-1, -2)
        torch.testing.assert_close(
            focused_linear_attention(q, k, v, focusing_factor=1, feature_scale=s),
            S @ v / (S.sum(-1, keepdim=True) + 1e-6),
        )


def test_a_large_focusing_factor_stays_finite():
    """(ReLU(x) + 1e-6)^p overflows float32 for large p; the focusing function is computed without it."""
    q, k, v = (t.float() * 50 for t in qkv(Nq=9, Nk=9))
    out = focused_linear_attention(q, k, v, focusing_factor=40)
    assert torch.isfinite(out).all()


def test_half_precision_keeps_its_dtype():
    q, k, v = (t.bfloat16() for t in qkv(Nq=21, Nk=21))
    out = focused_linear_attention(q, k, v, key_padding_mask=padding(2, 21, [21, 17]))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"dropout_p": 0.1}, ValueError, "dropout_p"),
        ({"focusing_factor": 0}, ValueError, "focusing_factor"),
        ({"focusing_factor": None}, TypeError, "focusing_factor"),
        ({"feature_scale": -1.0}, ValueError, "feature_scale must be finite and > 0"),
        ({"feature_scale": torch.zeros(2, 8, dtype=F64)}, ValueError, "feature_scale must be finite and > 0"),
        ({"feature_scale": torch.ones(3, 8, dtype=F64)}, ValueError, r"feature_scale must broadcast to \(Hkv=2, D=8\)"),
        ({"feature_scale": "one"}, TypeError, "feature_scale"),
        ({"key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError, "key_padding_mask"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        focused_linear_attention(q, k, v, **options)


def test_layer_learns_its_scale_and_convolves_values():
    layer = registry.build_layer("flatten:dwc=True,grid=(4,4),num_prefix_tokens=1", 32, 4)
    assert isinstance(layer, FLattenAttention) and isinstance(layer.dwc, torch.nn.Conv2d)
    assert layer.dwc.weight.shape == (8, 1, 5, 5)  # one 5x5 kernel per channel, shared by the heads
    x = torch.randn(2, 17, 32)
    mask = padding(2, 17, [17, 13])
    out = layer(x, attn_mask=mask)
    out.square().sum().backward()
    assert layer.feature_scale.theta.grad.abs().sum() > 0 and layer.dwc.weight.grad.abs().sum() > 0
    assert (out[1, 13:] == layer.proj.bias).all()
    with torch.no_grad():
        layer.dwc.weight.zero_()
        layer.dwc.bias.zero_()
        plain = registry.build_layer("flatten", 32, 4)
        plain.load_state_dict(layer.state_dict(), strict=False)
        torch.testing.assert_close(layer(x, attn_mask=mask), plain(x, attn_mask=mask))


def test_layer_defaults_follow_the_authors_comparison():
    """p = 3, scale softplus(0) = log 2, no convolution (the MiTA authors' ImageNet comparison code)."""
    layer = registry.build_layer("flatten", 32, 4)
    assert layer.focusing_factor == 3.0 and layer.dwc is None
    torch.testing.assert_close(layer.feature_scale(), torch.full((4, 8), 2.0).log())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"focusing_factor": -1.0}, "focusing_factor"),
        ({"dwc": True, "kernel_size": 4}, "kernel_size must be an odd int"),
        ({"grid": (0, 4)}, "grid must be None"),
        ({"num_prefix_tokens": -1}, "num_prefix_tokens must be an int >= 0"),
    ],
)
def test_layer_errors(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        registry.build_layer({"name": "flatten", **options}, 32, 4)


def test_layer_adds_only_its_scale_and_convolution():
    assert_layer_extras("flatten", {}, {"feature_scale"})
    assert_layer_extras("flatten", {"dwc": True}, {"feature_scale", "dwc"})
