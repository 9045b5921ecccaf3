"""Extreme inputs on every MiTA path: huge logits and scales, exact ties, option limits, torch.compile.

Issue 25's items 2, 10, 13, 15 and 18 (op part): each test failed before its fix.
"""

from __future__ import annotations

import pytest
import torch

from mita.layers import MiTAAttention
from mita.ops.mita import mita_attention

IMPLS = ["reference", "grouped", "fused"]


def _qkv(shape=(1, 1, 9, 8), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize(("dtype", "factor"), [(torch.float32, 1e5), (torch.float32, 1e15), (torch.float64, 1e10)])
def test_huge_logits_stay_finite_and_agree(dtype: torch.dtype, factor: float) -> None:
    """Scaled logits of ~1e9 (float32: 1e5 squared times 8**-0.5) to ~1e29 and 1e19 (float64): every path's
    output finite and (a one-hot softmax) equal to the reference's; its gradients finite. (A backward that
    recomputes probabilities from a saved log-sum-exp, as the fused kernel and flash attention do, has them
    only to the rounding of logits that large: ulp(1e10) is 1024 in float32, so they are not compared.)"""
    q, k, v = _qkv(dtype=dtype)
    q, k = q * factor, k * factor
    outs = {}
    for impl in IMPLS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        outs[impl] = mita_attention(*leaves, num_landmarks=3, topk=2, impl=impl)
        grads = torch.autograd.grad(outs[impl].sum(), leaves)
        assert torch.isfinite(outs[impl]).all() and all(torch.isfinite(g).all() for g in grads), impl
    for impl in IMPLS[1:]:
        torch.testing.assert_close(outs[impl], outs["reference"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["scale", "landmark_scale"])
def test_huge_scales_stay_finite(impl: str, which: str) -> None:
    q, k, v = _qkv(shape=(1, 2, 17, 8))
    out = mita_attention(q, k, v, num_landmarks=3, topk=4, num_routed=2, impl=impl, **{which: 1e30})
    ref = mita_attention(q, k, v, num_landmarks=3, topk=4, num_routed=2, impl="reference", **{which: 1e30})
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_routed", [1, 2])
def test_ties_go_to_the_lower_index_on_every_path(impl: str, num_routed: int) -> None:
    """Ten identical keys carrying different values, k = 3: the experts are the three lowest positions,
    so every path returns the same output (torch.topk alone picks tied keys in no documented order)."""
    B, H, N, D = 2, 2, 24, 8
    q, k, v = _qkv(shape=(B, H, N, D), dtype=torch.float64)
    k[:, :, 4:14] = 20 * q.mean(2, keepdim=True)  # positions 4..13 tie, and lead every landmark's affinities
    landmarks = q.mean(2, keepdim=True).expand(B, H, 3, D).contiguous()  # three identical experts: gates tie
    opts = dict(num_landmarks=3, topk=3, num_routed=num_routed, landmarks=landmarks, return_routing=True)
    out, routing = mita_attention(q, k, v, impl=impl, **opts)
    assert (routing.experts == torch.tensor([4, 5, 6])).all()
    assert (routing.routes == torch.arange(num_routed)).all()
    want, _ = mita_attention(q, k, v, impl="reference", **opts)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    ("options", "dtype", "match"),
    [
        (dict(num_landmarks=10**30), torch.float32, "num_landmarks must be an int in \\[1, 2\\*\\*31 - 1\\]"),
        (dict(topk=2**40), torch.float32, "topk must be an int in \\[1, 2\\*\\*31 - 1\\]"),
        (dict(num_landmarks=torch.tensor([3])), torch.float32, "num_landmarks must be an int"),
        (dict(scale=1e308), torch.float32, "scale=1e\\+308 is outside torch.float32's normal range"),
        (dict(landmark_scale=1e39), torch.bfloat16, "landmark_scale=1e\\+39 is outside torch.float32's"),
        (dict(scale=1e-320), torch.float32, "scale=1e-320 is outside torch.float32's normal range"),
        (dict(scale=1e-320), torch.float64, "scale=1e-320 is outside torch.float64's normal range"),
    ],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_option_limits_are_value_errors(options: dict, dtype: torch.dtype, match: str, impl: str) -> None:
    q, k, v = _qkv(dtype=dtype)
    with pytest.raises(ValueError, match=match):
        mita_attention(q, k, v, **{"num_landmarks": 3, "topk": 2, **options}, impl=impl)


def test_float64_takes_scales_float32_cannot() -> None:
    q, k, v = _qkv(dtype=torch.float64)
    out = mita_attention(q, k, v, num_landmarks=3, topk=2, scale=1e-300, impl="fused")
    torch.testing.assert_close(out, mita_attention(q, k, v, num_landmarks=3, topk=2, scale=1e-300, impl="reference"))


@pytest.mark.parametrize("impl", ["auto", "fused"])
def test_the_cpu_default_compiles_whole(impl: str) -> None:
    """torch.compile(fullgraph=True): no graph break in the default CPU path, forward and backward."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _qkv(shape=(2, 2, 33, 16)))
    fn = lambda q, k, v: mita_attention(q, k, v, num_landmarks=4, topk=5, num_routed=2, impl=impl)  # noqa: E731
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(out, fn(q, k, v))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for g, want in zip(grads, torch.autograd.grad(fn(q, k, v).square().sum(), (q, k, v))):
        torch.testing.assert_close(g, want)


def test_the_layer_compiles_whole_with_q_k_v_one_tensor() -> None:
    torch._dynamo.reset()
    layer = MiTAAttention(32, num_heads=2, num_landmarks=4, topk=5)
    x = torch.randn(2, 17, 32)
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x))
    x4 = torch.randn(1, 2, 20, 8)
    fn = lambda x: mita_attention(x, x, x, num_landmarks=4, topk=5)  # noqa: E731
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="aot_eager")(x4), fn(x4))
