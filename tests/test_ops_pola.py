"""PolaFormer's polarity-aware linear attention (issue 28): the polarity streams' closed forms, errors, the
layer. Its paths against each other, padding and gradcheck: ``test_ops_pairs.py``."""

from __future__ import annotations

import pytest
import torch

from _pairs import (
    assert_layer_extras,
)
from _zoo import F64, padding, qkv
from mita import attention as registry
from mita.ops.polaformer import polarity_linear_attention, polarity_linear_attention_reference

PATHS = [polarity_linear_attention, polarity_linear_attention_reference]


def test_streams_written_out():
    """Same-sign features [q+, q-] . [k+, k-] on the first half of V, opposite-sign [q-, q+] . [k+, k-] on the
    second, each S V / n / (S 1 / n + 1e-6) with x+- = ReLU(+-x / s)^p."""
    q, k, v = qkv(H=2, Hkv=2, Nq=9, Nk=11, D=7)
    p, s = 1 + 3 * torch.rand(2, 7, dtype=F64), 0.5 + torch.rand(2, 7, dtype=F64)

    def parts(x):
        x = x / s[None, :, None]
        return torch.relu(x) ** p[None, :, None], torch.relu(-x) ** p[None, :, None]

    (qp, qn), (kp, kn) = parts(q), parts(k)
    key = torch.cat([kp, kn], -1)
    halves = []
    for query, values in ((torch.cat([qp, qn], -1), v[..., :4]), (torch.cat([qn, qp], -1), v[..., 4:])):
        S = query @ key.transpose(-1, -2) / 11
        halves.append(S @ values / (S.sum(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(polarity_linear_attention(q, k, v, power=p, feature_scale=s), torch.cat(halves, -1))


def test_signs_flipped_together_change_nothing():
    """-q against -k swaps the positive and negative parts on both sides: both streams' scores are unchanged."""
    q, k, v = qkv(Nq=10, Nk=13)
    mask = padding(2, 13, [13, 8])
    torch.testing.assert_close(
        polarity_linear_attention(-q, -k, v, key_padding_mask=mask),
        polarity_linear_attention(q, k, v, key_padding_mask=mask),
    )


def test_positive_inputs_with_power_one_are_linear_attention_and_no_opposite_stream():
    """q, k >= 0 and p = 1: the same-sign stream is linear attention with the identity kernel, the opposite-sign
    stream has no score at all (its output is zero)."""
    q, k, v = (t.abs() for t in qkv(Nq=6, Nk=9))
    out = polarity_linear_attention(q, k, v, power=1.0)
    S = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 9
    want = S @ v.repeat_interleave(2, dim=1)[..., :4] / (S.sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out[..., :4], want)
    assert (out[..., 4:] == 0).all()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"dropout_p": 0.1}, ValueError, "dropout_p"),
        ({"power": 0.5}, ValueError, "power must be finite and >= 1"),
        ({"power": torch.full((2, 8), 0.9, dtype=F64)}, ValueError, "power must be finite and >= 1"),
        ({"power": torch.ones(2, 3, dtype=F64)}, ValueError, "power must broadcast"),
        ({"power": torch.ones(8, dtype=torch.long)}, TypeError, "power"),
        ({"feature_scale": float("inf")}, ValueError, "feature_scale"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        polarity_linear_attention(q, k, v, **options)


def test_layer_learns_power_and_scale():
    """p = 1 + 4 sigmoid(0) = 3 and s = softplus(0) at initialisation; both get gradients."""
    layer = registry.build_layer("pola", 32, 4)
    torch.testing.assert_close(layer.power(), torch.full((4, 8), 3.0))
    x = torch.randn(2, 17, 32)
    mask = padding(2, 17, [17, 12])
    out = layer(x, attn_mask=mask)
    out.square().sum().backward()
    assert layer.power.theta.grad.abs().sum() > 0 and layer.feature_scale.theta.grad.abs().sum() > 0
    assert (out[1, 12:] == layer.proj.bias).all()
    assert registry.build_layer("pola:alpha=2.0", 32, 4).power().max() == 2.0


def test_layer_adds_only_its_parameters():
    assert_layer_extras("pola", {}, {"power", "feature_scale"})
    assert_layer_extras("pola", {"dwc": True}, {"power", "feature_scale", "dwc"})


@pytest.mark.parametrize(
    ("options", "match"), [({"alpha": 0.0}, "alpha"), ({"dwc": True, "kernel_size": 0}, "kernel_size")]
)
def test_layer_errors(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        registry.build_layer({"name": "pola", **options}, 32, 4)
