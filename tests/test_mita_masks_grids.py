"""MiTA's padding per side (query_padding_mask), 3-D grids, and its argument checks, on every path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mita import MiTAAttention, attention, mita_attention
from mita.ops.mita import fused
from mita.ops.mita.config import check as mita_check
from mita.ops.pooling import check_pooling, pool, pool_bins

F64 = torch.float64
IMPLS = ["reference", "grouped", "fused"]


def rand(*shape, dtype=F64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(B=2, H=2, Nq=24, Nk=24, D=8, Hkv=None, seed=0, dtype=F64):
    return rand(B, H, Nq, D, seed=seed, dtype=dtype), *(
        rand(B, Hkv or H, Nk, D, seed=seed + i, dtype=dtype) for i in (1, 2)
    )


def lengths(B: int, N: int, real: list[int]) -> torch.Tensor:
    return torch.arange(N)[None] < torch.tensor(real)[:, None]


# --- query_padding_mask (issue 12 item 3) ---------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_equal_length_cross_attention_is_not_self_attention(impl: str) -> None:
    """Cross-attention with Nq == Nk says so with a query mask; one more padded key then changes nothing.

    Before query_padding_mask, Nq == Nk with a key mask was taken for self-attention: real queries at
    padded key positions got zero output and the landmarks pooled the wrong queries.
    """
    q, k, v = qkv(Nq=20, Nk=20)
    keys = lengths(2, 20, [20, 13])
    everyone = torch.ones(2, 20, dtype=torch.bool)
    opts = dict(num_landmarks=4, topk=5, num_routed=2, impl=impl)
    out = mita_attention(q, k, v, key_padding_mask=keys, query_padding_mask=everyone, **opts)
    pad = torch.zeros(2, 2, 1, 8, dtype=F64)
    longer = mita_attention(
        q,
        torch.cat([k, pad], 2),
        torch.cat([v, pad], 2),
        key_padding_mask=torch.cat([keys, keys[:, :1] & False], 1),
        **opts,
    )
    torch.testing.assert_close(out, longer, rtol=1e-10, atol=1e-12)
    assert out[1, :, 13:].abs().sum() > 0  # real queries at padded key positions have outputs


@pytest.mark.parametrize("impl", IMPLS)
def test_self_attention_key_mask_alone_equals_both_masks(impl: str) -> None:
    q, k, v = qkv(Nq=30, Nk=30)
    mask = lengths(2, 30, [30, 17])
    opts = dict(num_landmarks=5, topk=6, impl=impl, num_prefix_tokens=1)
    one = mita_attention(q, k, v, key_padding_mask=mask, **opts)
    both = mita_attention(q, k, v, key_padding_mask=mask, query_padding_mask=mask, **opts)
    torch.testing.assert_close(one, both, rtol=0, atol=0)
    assert (one[1, :, 17:] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grid", [None, (4, 5), (2, 2, 5)], ids=["1d", "2d", "3d"])
def test_padded_queries_take_no_part(impl: str, grid) -> None:
    """Cross-attention with padded queries: zero rows, and the real rows ignore what the padded ones hold."""
    q, k, v = qkv(Nq=21, Nk=33)
    keys = lengths(2, 33, [33, 20])
    queries = torch.ones(2, 21, dtype=torch.bool)
    queries[1, 15:] = False
    queries[0, 3] = False
    m = 4 if grid is None else (2, 2) if len(grid) == 2 else (1, 2, 2)
    opts = dict(num_landmarks=m, topk=6, grid=grid, num_prefix_tokens=1, key_padding_mask=keys, impl=impl)
    out = mita_attention(q, k, v, query_padding_mask=queries, **opts)
    junk = q.masked_fill(~queries[:, None, :, None], 1e6)
    torch.testing.assert_close(mita_attention(junk, k, v, query_padding_mask=queries, **opts), out, rtol=0, atol=0)
    assert (out.masked_select(~queries[:, None, :, None]) == 0).all()
    ref = mita_attention(q, k, v, query_padding_mask=queries, **{**opts, "impl": "reference"})
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("impl", ["grouped", "fused"])
def test_query_mask_gradients_match_reference(impl: str) -> None:
    q, k, v = qkv(Nq=18, Nk=26, Hkv=1, H=2)
    keys, queries = lengths(2, 26, [26, 11]), lengths(2, 18, [12, 18])
    opts = dict(num_landmarks=3, topk=4, num_routed=2, key_padding_mask=keys, query_padding_mask=queries)
    grads = []
    for which in ("reference", impl):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        (mita_attention(*x, **opts, impl=which) * torch.linspace(-1, 1, 8, dtype=F64)).sum().backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_layers_pass_the_query_mask() -> None:
    layer = MiTAAttention(16, 2, num_landmarks=3, topk=4)
    x, mask = rand(2, 12, 16), lengths(2, 12, [12, 7])
    out = layer.double()(x, attn_mask=mask)
    assert (out[1, 7:] == layer.proj.bias).all()
    for name in attention.names():
        op_layer = attention.build_layer(name, 16, 2).double()
        y = op_layer(x, attn_mask=mask)
        assert (y[1, 7:] == op_layer.proj.bias).all(), name


@pytest.mark.parametrize("name", ["sdpa", "topk", "moba", "linear", "agent", "nystrom"])
def test_every_op_takes_a_query_mask(name: str) -> None:
    op = attention.build_op(
        name + {"moba": ":block_size=4", "agent": ":num_agents=3", "nystrom": ":num_landmarks=3"}.get(name, "")
    )
    q, k, v = qkv(Nq=10, Nk=10)
    keys = lengths(2, 10, [10, 6])
    everyone = torch.ones(2, 10, dtype=torch.bool)
    out = op(q, k, v, key_padding_mask=keys, query_padding_mask=everyone)
    assert out[1, :, 6:].abs().sum() > 0  # cross-attention: no query is padded
    assert (op(q, k, v, key_padding_mask=keys)[1, :, 6:] == 0).all()  # self-attention


# --- 3-D grids (issue 15 item 1) ------------------------------------------------------------

GRIDS_3D = [
    dict(grid=(2, 3, 4), m=(1, 2, 2), prefix=0, mask=False),
    dict(grid=(4, 3, 3), m=8, prefix=1, mask=False),
    dict(grid=(3, 4, 4), m=(2, 2, 3), prefix=2, mask=slice(3, None, 3)),  # every third token padded
    dict(grid=(2, 2, 2), m=(2, 2, 2), prefix=1, mask=slice(0, 1)),  # one token a bin: the prefix padded
]


@pytest.mark.parametrize("impl", ["grouped", "fused"])
@pytest.mark.parametrize("case", GRIDS_3D, ids=["plain", "cube-prefix", "masked", "masked-prefix"])
def test_3d_grid_matches_reference(impl: str, case: dict) -> None:
    n = case["prefix"] + int(np.prod(case["grid"]))
    q, k, v = qkv(Nq=n, Nk=n, H=4, Hkv=2)
    mask = None
    if case["mask"]:
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, case["mask"]] = False
    opts = dict(num_landmarks=case["m"], topk=5, num_routed=2, grid=case["grid"], num_prefix_tokens=case["prefix"])
    outs, grads = [], []
    for which in ("reference", impl):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, routing = mita_attention(*x, **opts, key_padding_mask=mask, impl=which, return_routing=True)
        out.square().sum().backward()
        outs.append((out, routing.landmarks))
        grads.append([t.grad for t in x])
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=1e-12)
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_3d_pooling_is_adaptive_avg_pool3d() -> None:
    q = rand(1, 2, 1 + 4 * 6 * 6, 8)
    _, routing = mita_attention(
        q, q, q, num_landmarks=(2, 3, 3), topk=4, grid=(4, 6, 6), num_prefix_tokens=1, return_routing=True
    )
    video = q[:, :, 1:].transpose(-1, -2).reshape(2, 8, 4, 6, 6)
    expected = torch.nn.functional.adaptive_avg_pool3d(video, (2, 3, 3)).reshape(1, 2, 8, 18).transpose(-1, -2)
    torch.testing.assert_close(routing.landmarks, expected)


@pytest.mark.parametrize(
    "m, grid, prefix, n",
    [(5, None, 0, 63), (7, None, 2, 40), ((2, 3), (5, 7), 0, 35), (25, (14, 14), 1, 197), (8, (2, 4, 4), 1, 33)],
)
def test_pool_bins_are_the_adaptive_pooling_bins(m, grid, prefix, n) -> None:
    """The bins the fused kernel pools by give pool()'s landmarks, every token in exactly one
    bin per axis range, in row-major order."""
    pooling = check_pooling(m, grid, prefix, n)
    offsets, tokens = pool_bins(pooling, n)
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and len(offsets) == pooling.m + 1
    assert bool((tokens >= prefix).all()) and bool((tokens < n).all()) and bool((offsets.diff() > 0).all())
    x = rand(2, 3, n, 4)
    by_bins = torch.stack([x[:, :, tokens[a:b]].mean(2) for a, b in itertools.pairwise(offsets)], 2)
    torch.testing.assert_close(by_bins, pool(x, pooling), rtol=0, atol=1e-14)


def test_3d_gradcheck_fused() -> None:
    q, k, v = (t.requires_grad_() for t in qkv(B=1, H=1, Nq=9, Nk=9, D=4))
    mask = lengths(1, 9, [8])
    fn = lambda q, k, v: mita_attention(  # noqa: E731
        q,
        k,
        v,
        num_landmarks=(1, 1, 2),
        topk=3,
        grid=(2, 2, 2),
        num_prefix_tokens=1,
        key_padding_mask=mask,
        impl="fused",
    )
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_layer_takes_a_3d_grid() -> None:
    layer = MiTAAttention(16, 2, num_landmarks=(1, 2, 2), topk=4, grid=(2, 4, 4), num_prefix_tokens=1).double()
    out = layer(rand(2, 33, 16))
    assert out.shape == (2, 33, 16)
    with pytest.raises(ValueError, match="grid=\\(2, 4, 4\\) holds 32 tokens"):
        layer(rand(2, 30, 16))


GRID_ERRORS = {
    "not-a-cube": (dict(grid=(2, 3, 4), num_landmarks=9), "perfect cube"),
    "pair-for-3d": (dict(grid=(2, 3, 4), num_landmarks=(2, 2)), "perfect cube int or \\(mt, mh, mw\\)"),
    "wrong-size": (dict(grid=(2, 3, 3), num_landmarks=8), "holds 18 tokens"),
    "bool-in-grid": (dict(grid=(True, 4, 6), num_landmarks=8), "grid must be None"),
    "four-dims": (dict(grid=(1, 2, 3, 4), num_landmarks=8), "grid must be None"),
    "zero": (dict(grid=(0, 4, 6), num_landmarks=8), "grid must be None"),
}


@pytest.mark.parametrize("name", list(GRID_ERRORS))
def test_3d_grid_errors(name: str) -> None:
    override, match = GRID_ERRORS[name]
    q, k, v = qkv(Nq=24, Nk=24)
    with pytest.raises(ValueError, match=match):
        mita_attention(q, k, v, topk=3, **override)


# --- argument checks, the same on every path (issue 12 items 4, 16, 17) ----------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["scale", "landmark_scale"])
@pytest.mark.parametrize("value", [0.0, -0.5, float("nan"), float("inf")])
def test_scales_must_be_positive_and_finite(impl: str, name: str, value: float) -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"{name} must be positive and finite"):
        mita_attention(q, k, v, num_landmarks=3, topk=4, impl=impl, **{name: value})


def test_scale_of_the_wrong_type() -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError, match="scale must be a positive float"):
        mita_attention(q, k, v, num_landmarks=3, topk=4, scale="0.5")


@pytest.mark.parametrize("impl", ["auto", "grouped", "reference"])
def test_autocast_bfloat16_with_float32_inputs(impl: str) -> None:
    q, k, v = qkv(dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        out = mita_attention(q, k, v, num_landmarks=3, topk=4, num_routed=2, impl=impl)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = mita_attention(q, k, v, num_landmarks=3, topk=4, num_routed=2, impl="reference")
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("impl", ["auto", "grouped", "reference"])
def test_autocast_keeps_float64_like_sdpa(impl: str) -> None:
    """Autocast casts float32 and float16 inputs, never float64 ones (issue 25, item 14)."""
    q, k, v = qkv(dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        out = mita_attention(q, k, v, num_landmarks=3, topk=4, impl=impl)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.dtype == sdpa.dtype == torch.float64
    torch.testing.assert_close(out, mita_attention(q, k, v, num_landmarks=3, topk=4, impl="reference"))


def test_float16_reference_does_not_overflow() -> None:
    q, k, v = (40 * t for t in qkv(Nq=16, Nk=16, D=64, dtype=torch.float32))  # q . k ~ 1e5 > float16's max
    outs = {impl: mita_attention(q.half(), k.half(), v.half(), num_landmarks=2, topk=4, impl=impl) for impl in IMPLS}
    for impl, out in outs.items():
        assert torch.isfinite(out).all(), impl
    torch.testing.assert_close(outs["reference"], outs["fused"], rtol=2e-2, atol=0.5)


@pytest.mark.parametrize("impl", IMPLS)
def test_numpy_ints_and_0d_tensors_are_ints(impl: str) -> None:
    q, k, v = qkv()
    plain = mita_attention(q, k, v, num_landmarks=4, topk=5, num_routed=2, impl=impl)
    for m, t, s in [(np.int64(4), np.int32(5), np.int16(2)), (torch.tensor(4), torch.tensor(5), torch.tensor(2))]:
        out = mita_attention(q, k, v, num_landmarks=m, topk=t, num_routed=s, impl=impl)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)


ARG_ERRORS = {
    "bool-topk": (dict(topk=True), ValueError, "topk must be an int"),
    "float-tensor-m": (dict(num_landmarks=torch.tensor(4.0)), ValueError, "num_landmarks must be an int"),
    "dropout-str": (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float in \\[0, 1\\), got str"),
    "query-mask-shape": (
        dict(query_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
        ValueError,
        "query_padding_mask must have shape",
    ),
    "query-mask-dtype": (
        dict(query_padding_mask=torch.ones(2, 24)),
        TypeError,
        "query_padding_mask must be a bool tensor",
    ),
    "no-real-query": (dict(query_padding_mask=torch.zeros(2, 24, dtype=torch.bool)), ValueError, "no real query"),
}


@pytest.mark.parametrize("name", list(ARG_ERRORS))
def test_argument_errors(name: str) -> None:
    override, exc, match = ARG_ERRORS[name]
    q, k, v = qkv()
    with pytest.raises(exc, match=match):
        mita_attention(q, k, v, **{"num_landmarks": 3, "topk": 4, **override})


def test_meta_tensors_are_refused_clearly() -> None:
    q = torch.empty(1, 2, 16, 8, device="meta")
    with pytest.raises(ValueError, match="meta tensors"):
        mita_attention(q, q, q, num_landmarks=2, topk=3)


def test_fused_error_lists_its_reasons() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p=0\.1 .*; branches='routed'"):
        mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused", dropout_p=0.1, branches="routed")
    assert fused.not_supported_reasons(q, mita_check(q, k, v, num_landmarks=3, topk=4), 0.0) == []


LAYER_ERRORS = {
    "bogus-impl": (dict(impl="bogus"), "impl must be one of"),
    "bogus-branches": (dict(branches="none"), "branches must be"),
    "4d-grid": (dict(grid=(1, 2, 3, 4)), "grid must be None, 'auto'"),
    "zero-heads": (dict(num_heads=0), "num_heads must be an int >= 1"),
}


@pytest.mark.parametrize("name", list(LAYER_ERRORS))
def test_layer_errors_at_construction(name: str) -> None:
    override, match = LAYER_ERRORS[name]
    with pytest.raises(ValueError, match=match):
        MiTAAttention(**{"dim": 16, "num_heads": 2, **override})


def test_layer_on_a_2d_input() -> None:
    with pytest.raises(ValueError, match="takes x of shape \\(B, N, C\\)"):
        MiTAAttention(16, 2)(torch.randn(12, 16))


def test_build_layer_with_zero_heads() -> None:
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        attention.build_layer("sdpa", 16, num_heads=0)


def test_duplicate_config_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="'topk' is given twice"):
        attention.parse("mita:topk=4,topk=5")
