"""MiTA's options against repeated tokens (issue 31): ``landmark_pooling="distinct"`` and
``merge_duplicates=True``, in the operator and the layer, against the spec and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from mita import MiTAAttention, attention, mita_attention
from mita.ops.mita import IMPLEMENTATIONS, MiTAConfig, _auto, fused
from mita.ops.mita.config import check
from mita.ops.mita.landmarks import distinct_landmarks, key_offsets
from mita.ops.pooling import check_pooling, pool
from mita.ops.tiling import zero_padding

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


def merged_by_channels(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: MiTAConfig,
    landmarks: torch.Tensor | None,
    impl: str,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Merged duplicates (``cfg.key_offset``) as a construction on the spec's operator, an independent
    check of the per-key offset the implementations take.

    Each head becomes a batch element of its own (the copies differ per head), every copy of a key
    but its group's first is masked, and two extra channels carry log(c) into the logits:
    q' = [q, 1, -1], k' = [k, log(c)/s0, 0], landmarks' = [q~, 1, 1], v' = [v, 0, 0], so
    q'.q~' = q.q~ (the gate), q~'.k' = q~.k + log(c)/s0 (the shared expert over every copy, the
    top-k by its mass) and s0 q'.k' = s0 q.k + log(c) (a kept key weighs as all its copies); the
    two extra output channels are dropped. Args as the implementations' (q (B, H, Nq, D), k and v
    (B, Hkv, Nk, D), the checked config, the landmarks or None, the dropout), ``impl`` the one to run
    on. Returns (out, (landmarks, experts, routes)) as they do.
    """
    B, H, Nq, D = q.shape
    G, Nk = H // k.shape[1], k.shape[2]
    q, k, v = zero_padding(q, k, v, cfg)
    if landmarks is None:
        landmarks = pool(q, cfg.pooling, cfg.query_mask)
    k, v = (t.repeat_interleave(G, dim=1) for t in (k, v))
    offset = cfg.key_offset.repeat_interleave(G, dim=1)  # (B, H, Nk): log(c) on each group's first key
    first = torch.isfinite(offset)
    one = q.new_ones(B, H, Nq, 1)
    q2 = torch.cat([q, one, -one], -1)
    k2 = torch.cat([k, (offset.clamp_min(0) / cfg.scale).to(k.dtype)[..., None], k.new_zeros(B, H, Nk, 1)], -1)
    v2 = torch.cat([v, v.new_zeros(B, H, Nk, 2)], -1)
    lm2 = torch.cat([landmarks, landmarks.new_ones(B, H, landmarks.shape[2], 2)], -1)
    real = torch.ones(B, Nq, dtype=torch.bool, device=q.device) if cfg.query_mask is None else cfg.query_mask
    q2, k2, v2, lm2 = (t.flatten(0, 1)[:, None] for t in (q2, k2, v2, lm2))
    folded = check(
        q2,
        k2,
        v2,
        num_landmarks=cfg.m,
        topk=cfg.topk,
        num_routed=cfg.num_routed,
        key_padding_mask=first.flatten(0, 1),
        query_padding_mask=real[:, None].expand(B, H, Nq).flatten(0, 1),
        scale=cfg.scale,
        landmark_scale=cfg.landmark_scale,
        landmarks=lm2,
        branches=cfg.branches,
        dropout_p=dropout_p,
    )
    out, (_, experts, routes) = IMPLEMENTATIONS[impl](q2, k2, v2, folded, landmarks=lm2, dropout_p=dropout_p)
    return out.view(B, H, Nq, D + 2)[..., :D], (landmarks, experts.view(B, H, cfg.m, -1), routes.view(B, H, Nq, -1))


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


def _merged_calls(dtype: torch.dtype, N: int, D: int, s: int):
    """q, k, v of repeated tokens in ``dtype`` (as float64 values), 2 kv heads for 4 query heads, a
    padded tail, and the merged call's options with landmarks fixed (so every dtype routes alike)."""
    q, k, v = (t.to(dtype).double() for t in _repeated(B=2, H=4, N=N, D=D, kinds=8, unique=N // 6, seed=3))
    k, v = k[:, ::2].contiguous(), v[:, ::2].contiguous()
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[0, N - 5 :] = False
    kw = dict(num_landmarks=4, topk=min(24, N // 8), num_routed=s, key_padding_mask=mask, merge_duplicates=True)
    _, routing = mita_attention(q, k, v, **kw, impl="reference", return_routing=True)
    return (q, k, v), {**kw, "landmarks": routing.landmarks.to(dtype).double()}


def _merged_results(inputs, kw, impl: str, dtype: torch.dtype):
    """(out, dq, dk, dv) of a merged call in ``dtype``, one fixed upstream gradient."""
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = mita_attention(*leaves, **{**kw, "landmarks": kw["landmarks"].to(dtype)}, impl=impl)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    return (out, *torch.autograd.grad(out, leaves, grad))


def _yardstick(N: int) -> str:
    """The implementation fused results are held to: the reference, or at long N the grouped path."""
    return "reference" if N < 100 else "grouped"


@pytest.mark.skipif(not FAST, reason="the fused kernel is not available")
@pytest.mark.parametrize("N,D,s", [(40, 6, 2), (1500, 64, 1)])
def test_fused_takes_the_offsets_in_place(N, D, s):
    """The kernels add the key offsets themselves (no folded heads, no extra channels): outputs and
    gradients equal the reference's in float64, with GQA and padded keys, head by head (N = 40) and
    phase by phase with experts of more queries than a block (N = 1,500, s = 1: about 375 each;
    against the grouped path, which the tests above hold to the reference: the reference's gathers
    take 24 s there)."""
    inputs, kw = _merged_calls(torch.float64, N, D, s)
    want = _merged_results(inputs, kw, _yardstick(N), torch.float64)
    got = _merged_results(inputs, kw, "fused", torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


@pytest.mark.skipif(not FAST, reason="the fused kernel is not available")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,D", [(40, 6), (1500, 64)])
def test_fused_merge_in_lower_precision(dtype, N, D):
    """Merged duplicates in float32 and half precision (bfloat16 products where the CPU has them):
    outputs and gradients within twice the error of the reference in the same dtype, against float64."""
    inputs, kw = _merged_calls(dtype, N, D, 2 if N < 100 else 1)
    exact = _merged_results(inputs, kw, _yardstick(N), torch.float64)
    baseline = _merged_results(inputs, kw, _yardstick(N), dtype)
    got = _merged_results(inputs, kw, "fused", dtype)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), got, baseline, exact):
        assert a.dtype == dtype, name
        bound = 2 * (b.double() - e).abs().max().item() + 1e-6 * e.abs().max().item()
        assert (a.double() - e).abs().max().item() <= bound, name


@pytest.mark.skipif(not FAST, reason="the fused kernel is not available")
def test_fused_refuses_bad_key_offsets():
    """The kernels check the offsets: shape (B, Hkv, Nk), the compute dtype, contiguous."""
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    landmarks = torch.randn(1, 2, 4, 8)
    good = torch.zeros(1, 2, 16)
    for bad in (torch.zeros(1, 2, 15), good.double(), torch.zeros(1, 16, 2).transpose(1, 2)):
        with pytest.raises(RuntimeError, match="key_offset must be a contiguous"):
            torch.ops.mita.fused_forward(q, k, v, landmarks, None, None, 4, 1, 0.3, 0.3, None, None, bad)
    out = torch.ops.mita.fused_forward(q, k, v, landmarks, None, None, 4, 1, 0.3, 0.3, None, None, good)
    plain = torch.ops.mita.fused_forward(q, k, v, landmarks, None, None, 4, 1, 0.3, 0.3, None, None)
    torch.testing.assert_close(out[0], plain[0], rtol=0, atol=0)  # offsets of 0: the spec's operator


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
