"""MiTAAttention: a drop-in for timm's Attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from mita import MiTAAttention, mita_attention
from mita.ops.mita import official_landmarks

Attention = pytest.importorskip("timm.models.vision_transformer").Attention


def _heads(layer: nn.Module, x: torch.Tensor):
    B, N, _ = x.shape
    qkv = layer.qkv(x).reshape(B, N, 3, layer.num_heads, layer.head_dim).permute(2, 0, 3, 1, 4)
    return qkv.unbind(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"qkv_bias": True, "qk_norm": True, "norm_layer": nn.LayerNorm},
        {"proj_bias": False, "scale_norm": True, "norm_layer": nn.LayerNorm},
    ],
    ids=["plain", "qkv_bias-qk_norm", "scale_norm"],
)
def test_state_dict_moves_both_ways(kwargs: dict) -> None:
    timm_attn = Attention(64, num_heads=4, **kwargs)
    layer = MiTAAttention(64, num_heads=4, num_landmarks=4, topk=8, **kwargs)
    layer.load_state_dict(timm_attn.state_dict())  # strict
    back = Attention(64, num_heads=4, **kwargs)
    back.load_state_dict(layer.state_dict())
    for (n1, p1), (n2, p2) in zip(timm_attn.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_layer_is_the_op_on_its_projections() -> None:
    layer = MiTAAttention(
        48, num_heads=3, num_landmarks=(2, 2), topk=6, num_routed=2, grid="auto", num_prefix_tokens=1
    ).double()
    x = torch.randn(2, 17, 48, dtype=torch.float64)
    q, k, v = _heads(layer, x)
    o = mita_attention(q, k, v, num_landmarks=(2, 2), topk=6, num_routed=2, grid=(4, 4), num_prefix_tokens=1)
    expected = layer.proj(o.transpose(1, 2).reshape(2, 17, 48))
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)


def test_same_weights_other_operator() -> None:
    """Loaded timm weights run MiTA, not softmax attention: same shapes, other outputs."""
    timm_attn = Attention(32, num_heads=2)
    layer = MiTAAttention(32, num_heads=2, num_landmarks=3, topk=5)
    layer.load_state_dict(timm_attn.state_dict())
    x = torch.randn(2, 20, 32)
    assert layer(x).shape == timm_attn(x).shape
    assert not torch.allclose(layer(x), timm_attn(x))


def test_call_time_hyperparameters_and_routing_record() -> None:
    layer = MiTAAttention(32, num_heads=2, num_landmarks=3, topk=4)
    x = torch.randn(1, 40, 32)
    layer.record_routing = True
    layer(x)
    assert layer.routing.experts.shape == (1, 2, 3, 4) and layer.routing.routes.shape == (1, 2, 40, 1)
    layer.num_landmarks, layer.topk, layer.num_routed = 6, 10, 2
    layer(x)
    assert layer.routing.experts.shape == (1, 2, 6, 10) and layer.routing.routes.shape == (1, 2, 40, 2)


def test_padding_mask_and_errors() -> None:
    layer = MiTAAttention(32, num_heads=2, num_landmarks=3, topk=4)
    x = torch.randn(2, 12, 32)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    out = layer(x, attn_mask=mask)
    x2 = x.clone()
    x2[1, 7:] = 100.0  # padded tokens do not matter
    torch.testing.assert_close(layer(x2, attn_mask=mask)[1, :7], out[1, :7])
    with pytest.raises(ValueError, match="attn_mask must be a bool padding mask"):
        layer(x, attn_mask=mask.float())
    with pytest.raises(ValueError, match="attn_mask must be a bool padding mask"):
        layer(x, attn_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="causal"):
        layer(x, is_causal=True)
    with pytest.raises(ValueError, match="grid='auto' needs a square"):
        MiTAAttention(32, num_heads=2, num_landmarks=4, topk=4, grid="auto")(x)
    with pytest.raises(ValueError, match="compat must be"):
        MiTAAttention(32, num_heads=2, compat="authors")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MiTAAttention(30, num_heads=4)
    with pytest.raises(ValueError, match="need a norm_layer"):
        MiTAAttention(32, num_heads=2, qk_norm=True)


def test_official_compat_pools_first_n_minus_1_tokens_with_scale_1_over_d() -> None:
    layer = MiTAAttention(64, num_heads=4, num_landmarks=25, topk=25, compat="official").double()
    x = torch.randn(2, 197, 64, dtype=torch.float64)
    q, k, v = _heads(layer, x)
    # the authors' landmarks: the first 196 tokens (CLS included) on a 14 x 14 grid, pooled to 5 x 5
    img = q[:, :, :196].reshape(2, 4, 14, 14, 16)
    lm = official_landmarks(q, 25)
    bins = [(0, 3), (2, 6), (5, 9), (8, 12), (11, 14)]  # adaptive_avg_pool2d bins for 14 -> 5
    for i, (r0, r1) in enumerate(bins):
        for j, (c0, c1) in enumerate(bins):
            torch.testing.assert_close(lm[:, :, i * 5 + j], img[:, :, r0:r1, c0:c1].mean((2, 3)))
    o = mita_attention(q, k, v, num_landmarks=25, topk=25, landmarks=lm, landmark_scale=1 / 16)
    torch.testing.assert_close(layer(x), layer.proj(o.transpose(1, 2).reshape(2, 197, 64)), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="N - 1 to be a square"):
        layer(torch.randn(1, 60, 64, dtype=torch.float64))


def test_layer_trains() -> None:
    torch.manual_seed(0)
    layer = MiTAAttention(32, num_heads=2, num_landmarks=4, topk=6, num_routed=2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, target = torch.randn(4, 30, 32), torch.randn(4, 30, 32)
    losses = []
    for _ in range(5):
        loss = (layer(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert losses[-1] < losses[0]


def test_options_are_checked_at_construction_and_when_set() -> None:
    with pytest.raises(ValueError, match="num_landmarks must be an int >= 1, got 0"):
        MiTAAttention(dim=64, num_heads=4, num_landmarks=0)
    with pytest.raises(ValueError, match="num_landmarks=6 with a 2-D grid must be a perfect square"):
        MiTAAttention(64, 4, num_landmarks=6, compat="official")  # the authors' landmarks are 2-D
    layer = MiTAAttention(64, 4, grid="auto", num_prefix_tokens=1)
    layer.num_landmarks = layer.topk = 49
    assert (layer.num_landmarks, layer.topk) == (49, 49)
    layer.num_landmarks, layer.topk = np.int64(16), torch.tensor(8)
    assert type(layer.num_landmarks) is int and type(layer.topk) is int
    for attr, value, match in [
        ("num_landmarks", 0, "num_landmarks must be an int >= 1"),
        ("num_landmarks", 50, "num_landmarks=50 with a 2-D grid must be a perfect square"),
        ("num_landmarks", (2, 2, 2), r"num_landmarks with a 2-D grid must be a perfect square int or \(mh, mw\)"),
        ("topk", 0, "topk must be an int >= 1"),
        ("topk", True, "topk must be an int >= 1"),
        ("num_routed", 2.0, "num_routed must be an int >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            setattr(layer, attr, value)
    assert (layer.num_landmarks, layer.topk, layer.num_routed) == (16, 8, 1)  # a refused value changes nothing
    layer.num_routed = 17  # s <= m is checked per call, so m and s can be changed in either order
    with pytest.raises(ValueError, match=r"num_routed must be an int in \[1, 16\], got 17"):
        layer(torch.randn(1, 65, 64))
