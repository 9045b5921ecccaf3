"""InLine attention (issue 28): the injective normalisation's closed forms, errors, the layer and its local
residual. Its paths against each other, padding and gradcheck: ``test_ops_pairs.py``."""

from __future__ import annotations

import pytest
import torch

from _pairs import (
    assert_layer_extras,
)
from _zoo import F64, padding, qkv
from mita import attention as registry
from mita.layers import InLineAttention
from mita.ops.inline import inline_attention, inline_attention_reference


def test_weights_written_out():
    """w_ij = 1/n + s (q_i . k_j - mean_l q_i . k_l) / n."""
    q, k, v = qkv(H=2, Hkv=2, Nq=9, Nk=11)
    scores = q @ k.transpose(-1, -2)
    w = (1 + 8**-0.5 * (scores - scores.mean(-1, keepdim=True))) / 11
    torch.testing.assert_close(inline_attention(q, k, v), w @ v)


@pytest.mark.parametrize("op", [inline_attention, inline_attention_reference], ids=["fast", "ref"])
def test_rows_sum_to_one_without_a_division(op):
    """Constant values come out unchanged (the weights of every row sum to 1, over the real keys only);
    a zero query reads the mean value; scaling a query changes its output (injective)."""
    q, k, v = qkv(Nq=10, Nk=12)
    mask = padding(2, 12, [12, 7])
    ones = torch.full_like(v, 2.5)
    torch.testing.assert_close(op(q, k, ones, key_padding_mask=mask), torch.full((2, 4, 10, 8), 2.5, dtype=F64))
    mean = torch.stack([v[0].mean(1), v[1, :, :7].mean(1)]).repeat_interleave(2, dim=1)
    torch.testing.assert_close(op(torch.zeros_like(q), k, v, key_padding_mask=mask)[:, :, 3], mean)
    assert not torch.allclose(op(2 * q, k, v), op(q, k, v))


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"dropout_p": 0.1}, ValueError, "dropout_p"),
        ({"scale": 0.0}, ValueError, "scale must be positive"),
        ({"scale": "x"}, TypeError, "scale"),
        ({"query_padding_mask": torch.ones(2, 7)}, TypeError, "query_padding_mask"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        inline_attention(q, k, v, **options)


@pytest.mark.parametrize(
    ("options", "grid_shape"),
    [
        ({}, ()),
        ({"grid": (4, 4), "num_prefix_tokens": 1}, (3, 3)),
        ({"grid": (2, 2, 4), "num_prefix_tokens": 1}, (3, 3, 3)),
    ],
    ids=["1d", "2d", "3d"],
)
def test_local_residual_is_a_predicted_depthwise_convolution(options, grid_shape):
    """The residual: per image, a depth-wise 3^d convolution of V whose kernels an MLP predicts from the mean
    real token; zero on the prefix and on padded tokens."""
    layer = InLineAttention(32, 4, **options).double()
    x = torch.randn(2, 17, 32, dtype=F64)
    mask = padding(2, 17, [17, 13])
    out = layer(x, attn_mask=mask)
    assert (out[1, 13:] == layer.proj.bias).all()
    plain = InLineAttention(32, 4, local_residual=False, **options).double()
    plain.load_state_dict(layer.state_dict(), strict=False)
    B, N, C = x.shape
    q, k, v = layer.qkv(x).reshape(B, N, 3, 4, 8).permute(2, 0, 3, 1, 4)
    real = mask[..., None]
    mean = (x * real).sum(1) / real.sum(1)
    kernels = layer.residual(mean[..., None]).view(B, C, *grid_shape or (3,))
    grid = options.get("grid")
    p = options.get("num_prefix_tokens", 0)
    local = torch.zeros(B, N, C, dtype=F64)
    for b in range(B):
        vb = v[b].masked_fill(~mask[b, None, :, None], 0)[:, p:]  # (H, L, D)
        img = vb.transpose(1, 2).reshape(C, *(grid or (-1,)))
        conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}
        y = conv[img.dim() - 1](img[None], kernels[b][:, None], padding=1, groups=C)[0]
        local[b, p:] = y.reshape(C, -1).T
    local = local.masked_fill(~mask[..., None], 0)
    with torch.no_grad():
        attn = inline_attention(q, k, v, key_padding_mask=mask).transpose(1, 2).reshape(B, N, C)
        torch.testing.assert_close(out, layer.proj(attn + local))
        torch.testing.assert_close(plain(x, attn_mask=mask), layer.proj(attn))


def test_layer_adds_only_its_residual_predictor():
    assert_layer_extras("inline", {}, {"residual"})
    assert_layer_extras("inline", {"local_residual": False}, set())


def test_layer_errors():
    with pytest.raises(ValueError, match="grid must be None"):
        registry.build_layer("inline:grid=(2,)", 32, 4)
    with pytest.raises(ValueError, match="grid='auto' needs a square number"):
        registry.build_layer("inline:grid='auto'", 32, 4)(torch.randn(1, 7, 32))
