"""MiTA's options against repeated tokens (issue 31): ``landmark_pooling="distinct"`` and
``merge_duplicates=True``, in the operator and the layer, against the spec and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from mita import MiTAAttention, attention, mita_attention
from mita.ops.mita import _auto, fused, merged_by_channels
from mita.ops.mita.config import check
from mita.ops.mita.landmarks import distinct_landmarks, key_offsets
from mita.ops.pooling import check_pooling, pool

IMPLS = ["reference", "grouped"]
FAST = ["fused"] if fused.available() else []


def _repeated(B=2, H=2, N=40, D=6, kinds=6, unique=6, seed=0, dtype=torch.float64):
    """q, k, v (B, H, N, D) of ``kinds`` token kinds repeated along the sequence, the first ``unique``
    tokens distinct; one token pattern for every head (tokens repeat, not head vectors)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, H, kinds, 3 * D, generator=g, dtype=dtype)
    pick = torch.randint(0, kinds, (B, 1, N), generator=g).expand(B, H, N)
    x = base.gather(2, pick[..., None].expand(-1, -1, -1, 3 * D)).clone()
    x[:, :, :unique] += torch.randn(B, H, unique, 3 * D, generator=g, dtype=dtype)
    return tuple(t.contiguous() for t in x.split(D, -1))


def _layer_pair(**options):
    """The default layer and one with ``options``, same weights, float64."""
    torch.manual_seed(0)
    plain = MiTAAttention(32, 2, num_landmarks=4, topk=5).double()
    other = MiTAAttention(32, 2, num_landmarks=4, topk=5, **options).double()
    other.load_state_dict(plain.state_dict())
    return plain, other


def test_off_by_default_is_the_spec_bit_for_bit():
    q, k, v = _repeated()
    cfg = check(q, k, v, num_landmarks=4, topk=5)
    assert cfg.landmark_pooling == "mean" and cfg.key_offset is None
    for impl in ("auto", *IMPLS):
        spec = mita_attention(q, k, v, num_landmarks=4, topk=5, impl=impl)
        same = mita_attention(q, k, v, num_landmarks=4, topk=5, impl=impl, landmark_pooling="mean")
        assert torch.equal(spec, same)
    layer = MiTAAttention(32, 2, num_landmarks=4, topk=5)
    assert (layer.landmark_pooling, layer.merge_duplicates) == ("mean", False)
    plain, explicit = _layer_pair(landmark_pooling="mean", merge_duplicates=False)
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    assert torch.equal(plain(x), explicit(x))
    # the dispatch is untouched by default: the fused kernels on CPU where they build, with or without merging
    fast = "fused" if fused.available() else "grouped"
    assert _auto(q, cfg, 0.0) == _auto(q, check(q, k, v, num_landmarks=4, topk=5, merge_duplicates=True), 0.0) == fast


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "N,kwargs",
    [
        (26, dict(num_landmarks=4)),
        (19, dict(num_landmarks=4, num_prefix_tokens=2, num_suffix_tokens=1)),
        (37, dict(num_landmarks=(2, 2), grid=(6, 6), num_prefix_tokens=1)),
        (29, dict(num_landmarks=(1, 2, 2), grid=(2, 3, 4), num_prefix_tokens=1, num_suffix_tokens=4)),
    ],
)
def test_no_repeats_is_the_spec(impl, N, kwargs):
    """No two tokens equal: every weight 1 / copies is 1 and every offset log 1 = 0, so both options
    together are the spec's operator (1-D, 2-D, 3-D, prefix and suffix tokens)."""
    q, k, v = (torch.randn(2, 2, N, 8, dtype=torch.float64) for _ in range(3))
    for s in (1, 2):
        spec = mita_attention(q, k, v, topk=5, num_routed=s, impl=impl, **kwargs)
        both = mita_attention(
            q, k, v, topk=5, num_routed=s, impl=impl, landmark_pooling="distinct", merge_duplicates=True, **kwargs
        )
        torch.testing.assert_close(both, spec, rtol=0, atol=1e-12)


def test_uniform_copies_pool_as_the_spec():
    """Every token repeated the same number of times: the weights 1 / copies are uniform, so the
    distinct landmarks are the spec's mean."""
    q, k, v = (torch.randn(2, 2, 8, 6, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.repeat(1, 1, 3, 1) for t in (q, k, v))  # 24 tokens, each of 8 kinds three times
    for impl in IMPLS:
        spec, r = mita_attention(q, k, v, num_landmarks=4, topk=5, impl=impl, return_routing=True)
        out, r2 = mita_attention(
            q, k, v, num_landmarks=4, topk=5, impl=impl, landmark_pooling="distinct", return_routing=True
        )
        torch.testing.assert_close(r2.landmarks, r.landmarks, rtol=0, atol=1e-12)
        torch.testing.assert_close(out, spec, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", [*IMPLS, *FAST])
@pytest.mark.parametrize("num_routed,branches", [(1, "both"), (2, "both"), (1, "routed"), (2, "routed")])
def test_merge_is_the_spec_when_experts_hold_every_key(impl, num_routed, branches):
    """k >= N: each spec expert holds every copy, each merged expert every distinct key with weight
    c, so the two operators are equal (closed form: sum over copies = c times one copy)."""
    if impl == "fused" and branches != "both":
        pytest.skip("the fused kernels compute both branches")
    q, k, v = _repeated()
    N = q.shape[2]
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, 31:] = False
    for m in (None, mask):
        kw = dict(num_landmarks=4, num_routed=num_routed, branches=branches, key_padding_mask=m, impl=impl)
        spec = mita_attention(q, k, v, topk=N, **kw)
        merged, r = mita_attention(q, k, v, topk=N, merge_duplicates=True, return_routing=True, **kw)
        torch.testing.assert_close(merged, spec, rtol=0, atol=1e-12)
        distinct = int(torch.isfinite(key_offsets(k, v, m)).sum(-1).max())
        assert r.experts.shape[-1] == distinct < N  # experts clamped to the distinct keys


def test_merge_ranks_distinct_keys_by_shared_mass():
    """Closed form: key 0 has mass e^(2.1 s0), the group of keys 1-3 3 e^(2.0 s0): with k = 1 the
    group wins, held once, its logit raised by log 3."""
    D = 4
    k = torch.tensor([[2.1, 0, 0, 0], [2.0, 0, 0, 0], [2.0, 0, 0, 0], [2.0, 0, 0, 0], [-1.0, 0, 0, 0]])[None, None]
    v = torch.randn(1, 1, 5, D)
    q = torch.tensor([[1.0, 0, 0, 0]]).expand(1, 1, 5, D).contiguous()
    landmarks = torch.tensor([[[[1.0, 0, 0, 0]]]])
    kw = dict(num_landmarks=1, topk=1, landmarks=landmarks, merge_duplicates=True, return_routing=True)
    for impl in IMPLS:
        _, r = mita_attention(q, k, v, impl=impl, **kw)
        assert r.experts.flatten().tolist() == [0]  # equal keys with other values are not merged
    v[:, :, 2:4] = v[:, :, 1:2]
    s0 = D**-0.5
    logits = torch.tensor([s0 * 1.0, s0 * 2.0 + math.log(3)])  # [landmark ; the merged key]
    p = torch.softmax(logits, 0)
    want = p[0] * (torch.softmax(s0 * k[0, 0, :, 0], 0) @ v[0, 0]) + p[1] * v[0, 0, 1]
    for impl in IMPLS:
        out, r = mita_attention(q, k, v, impl=impl, **kw)
        assert r.experts.flatten().tolist() == [1]
        torch.testing.assert_close(out[0, 0], want.expand(5, D))


@pytest.mark.parametrize("impl", [*IMPLS, *FAST])
@pytest.mark.parametrize("num_routed,topk,branches", [(1, 6, "both"), (2, 4, "both"), (1, 5, "routed")])
def test_merge_matches_the_construction_on_the_spec(impl, num_routed, topk, branches):
    """The per-key offset of the reference and the grouped path equals the construction on the
    spec's reference (:func:`merged_by_channels`: copies masked, log c in two extra channels), and
    so does that construction on the fused kernels; distinct landmarks, padding and GQA."""
    if impl == "fused" and branches != "both":
        pytest.skip("the fused kernels compute both branches")
    q, k, v = _repeated(H=4)
    k, v = k[:, ::2].contiguous(), v[:, ::2].contiguous()  # 2 kv heads for 4 query heads
    mask = torch.ones(2, q.shape[2], dtype=torch.bool)
    mask[0, 33:] = False
    for m in (None, mask):
        lm = distinct_landmarks(q, 4, query_padding_mask=m)
        kw = dict(num_landmarks=4, topk=topk, num_routed=num_routed, key_padding_mask=m, branches=branches)
        cfg = check(q, k, v, **kw, landmarks=lm, merge_duplicates=True)
        want = merged_by_channels(q, k, v, cfg, lm, "reference")[0]
        got = mita_attention(
            q,
            k,
            v,
            num_landmarks=4,
            topk=topk,
            num_routed=num_routed,
            key_padding_mask=m,
            branches=branches,
            landmark_pooling="distinct",
            merge_duplicates=True,
            impl=impl,
        )
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", [*IMPLS, *FAST])
def test_gradcheck_float64(impl):
    """Gradients of both options (the weights and offsets are constants; copies within the
    tolerance stay one group under gradcheck's perturbations), with a padded key."""
    q, k, v = _repeated(B=1, H=1, N=12, D=4, kinds=3, unique=3, seed=1)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 11] = False

    def f(q, k, v):
        return mita_attention(
            q,
            k,
            v,
            num_landmarks=3,
            topk=3,
            num_routed=2,
            key_padding_mask=mask,
            landmark_pooling="distinct",
            merge_duplicates=True,
            impl=impl,
        )

    assert torch.autograd.gradcheck(f, tuple(t.clone().requires_grad_() for t in (q, k, v)))


def test_cross_attention_with_gqa():
    """Nq != Nk, 2 kv heads for 4 query heads, padded keys: every implementation agrees, and with
    k >= Nk the merge is the spec's operator."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 20, 8, dtype=torch.float64)
    pick = torch.randint(0, 5, (2, 1, 30, 1)).expand(2, 2, 30, 16)
    k, v = (t.contiguous() for t in torch.randn(2, 2, 5, 16, dtype=torch.float64).gather(2, pick).split(8, -1))
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 25:] = False
    kw = dict(
        num_landmarks=4, num_routed=2, key_padding_mask=mask, query_padding_mask=torch.ones(2, 20, dtype=torch.bool)
    )
    want = mita_attention(q, k, v, topk=6, landmark_pooling="distinct", merge_duplicates=True, impl="reference", **kw)
    for impl in ("grouped", *FAST):
        got = mita_attention(q, k, v, topk=6, landmark_pooling="distinct", merge_duplicates=True, impl=impl, **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    spec = mita_attention(q, k, v, topk=30, impl="reference", **kw)
    torch.testing.assert_close(mita_attention(q, k, v, topk=30, merge_duplicates=True, **kw), spec, rtol=0, atol=1e-12)


def test_padding_is_absence():
    """Padded tokens (holding NaN) change nothing: the output on the real tokens is that of the
    sequence without them (1-D), and the counts of copies ignore them."""
    q, k, v = _repeated(B=1, N=30)
    n = 24
    mask = torch.zeros(1, 30, dtype=torch.bool)
    mask[0, :n] = True
    padded = [t.clone() for t in (q, k, v)]
    for t in padded:
        t[:, :, n:] = float("nan")
    kw = dict(num_landmarks=3, topk=5, landmark_pooling="distinct", merge_duplicates=True)
    for impl in [*IMPLS, *FAST]:
        out = mita_attention(*padded, key_padding_mask=mask, impl=impl, **kw)
        want = mita_attention(*(t[:, :, :n] for t in (q, k, v)), impl=impl, **kw)
        torch.testing.assert_close(out[:, :, :n], want, rtol=0, atol=1e-12)
        assert (out[:, :, n:] == 0).all()


def test_half_precision_and_float32_paths_agree():
    q, k, v = _repeated(dtype=torch.float32)
    kw = dict(num_landmarks=4, topk=5, landmark_pooling="distinct", merge_duplicates=True)
    ref = mita_attention(q, k, v, impl="reference", **kw)
    torch.testing.assert_close(mita_attention(q, k, v, impl="grouped", **kw), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mita_attention(q, k, v, **kw), ref, rtol=1e-5, atol=1e-5)  # auto: fused on CPU
    for impl in ("grouped", *FAST):
        half = mita_attention(*(t.bfloat16() for t in (q, k, v)), impl=impl, **kw)
        assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    dropped = mita_attention(q, k, v, dropout_p=0.5, **kw)  # training with dropout: "auto" takes the grouped path
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, ref)


def test_layer_options_grids_prefix_and_gqa():
    """The layer is the operator on its projections with the options: 2-D grid with a prefix token,
    and grouped-query heads."""
    opts = dict(landmark_pooling="distinct", merge_duplicates=True)
    layer = MiTAAttention(48, 3, num_landmarks=(2, 2), topk=6, grid="auto", num_prefix_tokens=1, **opts).double()
    x = torch.randn(2, 17, 48, dtype=torch.float64)
    x[:, 5:12] = x[:, 4:5]  # a uniform region: repeated tokens
    B, N, _ = x.shape
    q, k, v = layer.qkv(x).reshape(B, N, 3, 3, 16).permute(2, 0, 3, 1, 4).unbind(0)
    o = mita_attention(q, k, v, num_landmarks=(2, 2), topk=6, grid=(4, 4), num_prefix_tokens=1, **opts)
    torch.testing.assert_close(layer(x), layer.proj(o.transpose(1, 2).reshape(B, N, 48)), rtol=0, atol=1e-12)
    gqa = MiTAAttention(32, 4, num_landmarks=4, topk=5, qkv_fused=False, num_kv_heads=2, **opts).double()
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, 15:] = False
    y = torch.randn(2, 20, 32, dtype=torch.float64)
    y[:, 10:] = y[:, 9:10]
    out = gqa(y, mask)
    assert out.shape == (2, 20, 32) and torch.isfinite(out).all()


def test_registry_builds_the_options():
    layer = attention.build_layer("mita:num_landmarks=4,topk=4,landmark_pooling=distinct,merge_duplicates=True", 32, 2)
    assert isinstance(layer, MiTAAttention) and (layer.landmark_pooling, layer.merge_duplicates) == ("distinct", True)
    assert "landmark_pooling=distinct, merge_duplicates=True" in repr(layer)
    op = attention.build_op("mita:num_landmarks=4,topk=4,landmark_pooling=distinct,merge_duplicates=True")
    q, k, v = _repeated()
    want = mita_attention(q, k, v, num_landmarks=4, topk=4, landmark_pooling="distinct", merge_duplicates=True)
    torch.testing.assert_close(op(q, k, v), want, rtol=0, atol=0)


def test_errors():
    q, k, v = _repeated()
    with pytest.raises(ValueError, match=r"landmark_pooling must be one of \['mean', 'distinct'\], got 'kmeans'"):
        mita_attention(q, k, v, num_landmarks=4, topk=4, landmark_pooling="kmeans")
    with pytest.raises(TypeError, match="merge_duplicates must be True or False, got int 1"):
        mita_attention(q, k, v, num_landmarks=4, topk=4, merge_duplicates=1)
    with pytest.raises(ValueError, match="landmarks= cannot be given too"):
        lm = pool(q, check_pooling(4, None, 0, q.shape[2]))
        mita_attention(q, k, v, num_landmarks=4, topk=4, landmarks=lm, landmark_pooling="distinct")
    with pytest.raises(ValueError, match="impl='triton' cannot run merge_duplicates=True"):
        mita_attention(q, k, v, num_landmarks=4, topk=4, merge_duplicates=True, impl="triton")
    if FAST:  # the construction keeps the kernels' own limits
        with pytest.raises(ValueError, match=r"impl='fused' cannot run this call: dropout_p=0.1"):
            mita_attention(q, k, v, num_landmarks=4, topk=4, merge_duplicates=True, impl="fused", dropout_p=0.1)
    with pytest.raises(ValueError, match="landmark_pooling must be one of"):
        MiTAAttention(32, 2, landmark_pooling="max")
    with pytest.raises(TypeError, match="merge_duplicates must be True or False"):
        MiTAAttention(32, 2, merge_duplicates="yes")
    with pytest.raises(ValueError, match="compat='official' reproduces the authors' operator"):
        MiTAAttention(32, 2, num_landmarks=4, compat="official", landmark_pooling="distinct")
    with pytest.raises(ValueError, match="merge_duplicates=True runs on impl 'auto' or one of"):
        MiTAAttention(32, 2, merge_duplicates=True, impl="triton")
