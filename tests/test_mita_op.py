"""The MiTA operator against the spec: the efficient path against the reference, closed forms, errors."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mita import mita_attention


@dataclass(frozen=True)
class Case:
    B: int = 2
    H: int = 2
    Hkv: int | None = None
    N: int = 63
    Nk: int | None = None  # cross-attention when set
    D: int = 16
    m: int | tuple[int, int] = 5
    k: int = 7
    s: int = 1
    grid: tuple[int, int] | None = None
    prefix: int = 0
    mask: bool = False

    def __str__(self) -> str:
        parts = [f"B{self.B}", f"H{self.H}" + (f"kv{self.Hkv}" if self.Hkv else ""), f"N{self.N}"]
        parts += [f"Nk{self.Nk}"] if self.Nk else []
        parts += [f"D{self.D}", f"m{self.m}", f"k{self.k}", f"s{self.s}"]
        parts += [f"grid{self.grid[0]}x{self.grid[1]}"] if self.grid else []
        parts += [f"prefix{self.prefix}"] if self.prefix else []
        parts += ["mask"] if self.mask else []
        return "-".join(parts)

    def inputs(self, dtype=torch.float64, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        hkv, nk = self.Hkv or self.H, self.Nk or self.N
        q = torch.randn(self.B, self.H, self.N, self.D, generator=g, dtype=dtype)
        k = torch.randn(self.B, hkv, nk, self.D, generator=g, dtype=dtype)
        v = torch.randn(self.B, hkv, nk, self.D, generator=g, dtype=dtype)
        mask = None
        if self.mask:
            mask = torch.rand(self.B, nk, generator=g) > 0.3
            mask[:, : self.prefix + 1] = True
            if self.B > 1 and self.grid is None:  # a short sequence: k gets clamped for it
                mask[1, self.prefix + 3 :] = False
        to = {"device": device}
        return q.to(**to), k.to(**to), v.to(**to), None if mask is None else mask.to(**to)

    def kwargs(self, mask):
        return dict(
            num_landmarks=self.m,
            topk=self.k,
            num_routed=self.s,
            grid=self.grid,
            num_prefix_tokens=self.prefix,
            key_padding_mask=mask,
        )


CASES = [
    Case(N=1, m=1, k=1, B=1),
    Case(N=1, m=3, k=4, s=2, B=1, H=3),
    Case(N=63, D=16, m=5, k=7, s=1),
    Case(N=63, D=60, m=8, k=9, s=3, H=3),
    Case(N=63, D=16, m=5, k=100, s=2, mask=True),
    Case(N=197, D=64, m=25, k=25, s=1, H=8, Hkv=2, B=1),
    Case(N=197, D=64, m=(5, 5), k=25, s=2, grid=(14, 14), prefix=1, H=3),
    Case(N=197, D=60, m=16, k=25, s=1, grid=(14, 14), prefix=1, mask=True),
    Case(N=197, D=16, m=9, k=30, s=3, prefix=4, mask=True, Hkv=1),
    Case(N=100, Nk=37, D=16, m=6, k=10, s=2),
    Case(N=40, Nk=150, D=64, m=7, k=20, s=1, H=4, Hkv=2, mask=True),
    Case(N=1000, D=64, m=16, k=32, s=1, B=1, H=1),
    Case(N=1000, D=16, m=32, k=16, s=3, B=1, H=3, Hkv=1, mask=True),
]
IDS = [str(c) for c in CASES]


def assert_same_routing(routing, ref, q: torch.Tensor, mask: torch.Tensor | None, case: Case) -> None:
    """Same landmarks, experts and routes, up to what rounding may decide.

    Slots of a short sequence's experts past its real keys hold padded keys in any order;
    routes are compared on real queries whose s-th and (s+1)-th gate values are not tied.
    """
    torch.testing.assert_close(routing.landmarks, ref.landmarks, rtol=0, atol=1e-12)
    e, r = routing.experts, ref.experts
    if mask is None:
        assert torch.equal(e, r)
    else:
        slot_real = torch.arange(e.shape[-1], device=e.device) < mask.sum(1).view(-1, 1, 1, 1)
        assert torch.equal(e[slot_real.expand_as(e)], r[slot_real.expand_as(r)])
        for b in range(e.shape[0]):  # padded slots hold padded keys
            assert not mask[b, e[b][(~slot_real[b]).expand_as(e[b])]].any()
    gate = (q @ ref.landmarks.transpose(-1, -2)).sort(-1, descending=True).values
    s = case.s
    clear = torch.ones_like(gate[..., 0], dtype=torch.bool)
    if s < gate.shape[-1]:
        clear = (gate[..., s - 1] - gate[..., s]) > 1e-9
    if mask is not None and not case.Nk:
        clear &= mask[:, None, :]  # padded queries' routes are arbitrary
    assert torch.equal(routing.routes.sort(-1).values[clear], ref.routes.sort(-1).values[clear])


@pytest.mark.parametrize("impl", ["grouped", "fused"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fast_paths_match_reference_float64(case: Case, impl: str, device: str) -> None:
    if impl == "fused" and device != "cpu":
        pytest.skip("the fused kernel is CPU-only")
    q, k, v, mask = case.inputs(device=device)
    ref, r_routing = mita_attention(q, k, v, **case.kwargs(mask), impl="reference", return_routing=True)
    with torch.no_grad():
        out, routing = mita_attention(q, k, v, **case.kwargs(mask), impl=impl, return_routing=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert (out - ref).abs().max().item() <= 1e-10
    assert_same_routing(routing, r_routing, q, mask, case)


@pytest.mark.parametrize("impl", ["grouped", "fused"])
@pytest.mark.parametrize("case", CASES[2:], ids=IDS[2:])
def test_fast_paths_match_reference_float32(case: Case, impl: str) -> None:
    q, k, v, mask = case.inputs(dtype=torch.float32)
    ref = mita_attention(q, k, v, **case.kwargs(mask), impl="reference")
    with torch.no_grad():
        out = mita_attention(q, k, v, **case.kwargs(mask), impl=impl)
    rel_rms = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel_rms <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("impl", ["fused", "grouped", "reference"])
def test_half_precision_close_to_float64(dtype: torch.dtype, impl: str) -> None:
    case = Case(N=120, D=32, m=8, k=16, s=2, mask=True)
    q, k, v, mask = case.inputs()
    ref, routing = mita_attention(q, k, v, **case.kwargs(mask), return_routing=True)
    # same landmarks for both, so that rounding cannot move a query to another expert
    out = mita_attention(
        *(t.to(dtype) for t in (q, k, v)), **case.kwargs(mask), landmarks=routing.landmarks.to(dtype), impl=impl
    )
    assert out.dtype == dtype
    rel_rms = ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert rel_rms < 0.05


GRAD_CASES = [CASES[2], CASES[4], CASES[6], CASES[9], CASES[10]]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[str(c) for c in GRAD_CASES])
def test_gradients_match_reference(case: Case) -> None:
    q, k, v, mask = case.inputs()
    grads = []
    for impl in ("reference", "grouped", "fused"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mita_attention(*leaves, **case.kwargs(mask), impl=impl)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
        grads.append([t.grad for t in leaves])
    for fast in grads[1:]:
        for a, b in zip(grads[0], fast):
            assert (a - b).abs().max().item() <= 1e-10


@pytest.mark.parametrize("impl", ["fused", "grouped", "reference"])
@pytest.mark.parametrize(
    "case",
    [
        Case(B=2, H=2, Hkv=1, N=7, D=3, m=3, k=4, s=2, mask=True),
        Case(B=1, H=1, N=10, D=3, m=(2, 2), k=3, grid=(3, 3), prefix=1),
    ],
    ids=["1d-gqa-mask-s2", "2d-prefix"],
)
def test_gradcheck(case: Case, impl: str) -> None:
    q, k, v, mask = case.inputs()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda *t: mita_attention(*t, **case.kwargs(mask), impl=impl), leaves, fast_mode=True
    )


def test_gradcheck_through_given_landmarks() -> None:
    q, k, v, _ = Case(B=1, H=2, N=8, D=4).inputs()
    lm = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda lm: mita_attention(q, k, v, num_landmarks=3, topk=3, num_routed=2, landmarks=lm)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (lm,), fast_mode=True)


# Closed forms ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["grouped", "reference"])
def test_all_experts_all_keys_is_softmax_over_landmarks_and_keys(impl: str) -> None:
    """k >= N and s = m: every key appears m times, i.e. log(m) is added to its logit."""
    B, H, N, D, m = 2, 3, 50, 8, 4
    q, k, v = torch.randn(3, B, H, N, D, dtype=torch.float64)
    out = mita_attention(q, k, v, num_landmarks=m, topk=N + 5, num_routed=m, impl=impl)
    lm = F.adaptive_avg_pool1d(q.flatten(0, 1).transpose(1, 2), m).transpose(1, 2).view(B, H, m, D)
    s0 = D**-0.5
    v_shared = torch.softmax(s0 * lm @ k.transpose(-1, -2), -1) @ v
    logits = torch.cat([s0 * q @ lm.transpose(-1, -2), s0 * q @ k.transpose(-1, -2) + math.log(m)], -1)
    expected = torch.softmax(logits, -1) @ torch.cat([v_shared, v], -2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_one_landmark_is_the_mean_query() -> None:
    q, k, v = torch.randn(3, 2, 2, 30, 8, dtype=torch.float64)
    _, routing = mita_attention(q, k, v, num_landmarks=1, topk=5, num_prefix_tokens=2, return_routing=True)
    torch.testing.assert_close(routing.landmarks, q[:, :, 2:].mean(2, keepdim=True))


def test_landmarks_pool_only_real_tokens_with_adaptive_bins() -> None:
    q, k, v = torch.randn(3, 2, 1, 20, 4, dtype=torch.float64)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, [3, 7, 8, 15, 19]] = False
    _, routing = mita_attention(q, k, v, num_landmarks=4, topk=3, key_padding_mask=mask, return_routing=True)
    real = q[0, :, mask[0]]  # 15 real tokens -> bins of adaptive_avg_pool1d
    expected = F.adaptive_avg_pool1d(real.transpose(1, 2), 4).transpose(1, 2)
    torch.testing.assert_close(routing.landmarks[0], expected)


def test_experts_and_routes_are_the_top_k_of_affinity_and_gate() -> None:
    q, k, v = torch.randn(3, 1, 2, 40, 8, dtype=torch.float64)
    _, r = mita_attention(q, k, v, num_landmarks=5, topk=6, num_routed=2, return_routing=True)
    A = r.landmarks @ k.transpose(-1, -2)
    assert torch.equal(r.experts.sort(-1).values, A.topk(6, -1).indices.sort(-1).values)
    gate = q @ r.landmarks.transpose(-1, -2)
    assert torch.equal(r.routes.sort(-1).values, gate.topk(2, -1).indices.sort(-1).values)
    assert r.experts.shape == (1, 2, 5, 6) and r.routes.shape == (1, 2, 40, 2)


def test_scale_and_landmark_scale() -> None:
    q, k, v, _ = Case(N=30, m=4, k=5, s=2).inputs()
    opts = dict(num_landmarks=4, topk=5, num_routed=2)
    out = mita_attention(q, k, v, **opts, scale=0.3, landmark_scale=0.05)
    torch.testing.assert_close(out, mita_attention(q, k, v, **opts, scale=0.3, landmark_scale=0.05, impl="reference"))
    assert not torch.allclose(out, mita_attention(q, k, v, **opts, scale=0.3))  # landmark_scale defaults to scale
    default = mita_attention(q, k, v, **opts)
    torch.testing.assert_close(default, mita_attention(q, k, v, **opts, scale=16**-0.5, landmark_scale=16**-0.5))


@pytest.mark.parametrize("branches", ["shared", "routed"])
def test_ablations_match_reference(branches: str) -> None:
    case = Case(N=80, m=6, k=9, s=2, mask=True)
    q, k, v, mask = case.inputs()
    out = mita_attention(q, k, v, **case.kwargs(mask), branches=branches)
    ref = mita_attention(q, k, v, **case.kwargs(mask), branches=branches, impl="reference")
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


# Masks, determinism, isolation ----------------------------------------------------------


def test_padding_takes_no_part() -> None:
    case = Case(N=60, m=5, k=8, s=2, mask=True)
    q, k, v, mask = case.inputs()
    out, r = mita_attention(q, k, v, **case.kwargs(mask), return_routing=True)
    assert out[~mask[:, None, :].expand(-1, q.shape[1], -1)].abs().max() == 0  # padded query rows are zero
    pad = ~mask[:, None, :, None]
    noisy = [t.masked_fill(pad, float("nan")) for t in (q, k, v)]  # garbage in padded slots
    out2 = mita_attention(*noisy, **case.kwargs(mask))
    assert torch.equal(out, out2)
    real_min = int(mask.sum(1).min())
    if case.k <= real_min:
        assert mask.gather(1, r.experts.flatten(1)).all()  # experts only hold real keys


@pytest.mark.parametrize("impl", ["fused", "grouped", "reference"])
def test_deterministic_bits(impl: str) -> None:
    case = Case(N=200, D=32, m=8, k=16, s=2, mask=True)
    q, k, v, mask = case.inputs(dtype=torch.float32)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mita_attention(*leaves, **case.kwargs(mask), impl=impl)
        out.sum().backward()
        runs.append([out, *(t.grad for t in leaves)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["fused", "grouped"])
def test_no_uninitialised_reads(impl: str) -> None:
    """Fresh allocations filled with NaN must not reach the output or the gradients."""
    case = Case(N=150, D=16, m=8, k=12, s=2, mask=True)
    q, k, v, mask = case.inputs()
    old = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        for s in (1, 2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = mita_attention(*leaves, **{**case.kwargs(mask), "num_routed": s}, impl=impl)
            out.sum().backward()
            assert all(torch.isfinite(t).all() for t in (out, *(x.grad for x in leaves)))
    finally:
        torch.use_deterministic_algorithms(old[0])
        torch.utils.deterministic.fill_uninitialized_memory = old[1]


@pytest.mark.parametrize("impl", ["fused", "grouped"])
@pytest.mark.parametrize("bad", ["nan_q", "inf_k", "nan_v"])
@pytest.mark.parametrize("s", [1, 2])
def test_nonfinite_batch_element_is_isolated(bad: str, s: int, impl: str) -> None:
    case = Case(B=3, N=70, m=5, k=9, s=s)
    q, k, v, _ = case.inputs()
    tensors = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    name, value = bad.split("_")[1], float(bad.split("_")[0])
    tensors[name][1, :, 10:20] = value
    out = mita_attention(tensors["q"], tensors["k"], tensors["v"], **case.kwargs(None), impl=impl)
    clean = mita_attention(q, k, v, **case.kwargs(None), impl=impl)
    assert torch.equal(out[[0, 2]], clean[[0, 2]])
    leaves = [t.requires_grad_() for t in tensors.values()]
    mita_attention(*leaves, **case.kwargs(None), impl=impl).sum().backward()
    assert all(torch.isfinite(t.grad[[0, 2]]).all() for t in leaves)


def test_k_larger_than_real_keys_is_clamped() -> None:
    q, k, v = torch.randn(3, 1, 1, 12, 4, dtype=torch.float64)
    big = mita_attention(q, k, v, num_landmarks=2, topk=1000)
    exact = mita_attention(q, k, v, num_landmarks=2, topk=12)
    torch.testing.assert_close(big, exact, rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2),
    H=st.sampled_from([1, 2, 4]),
    G=st.sampled_from([1, 2]),
    N=st.integers(1, 90),
    D=st.sampled_from([3, 8]),
    m=st.integers(1, 9),
    k=st.integers(1, 40),
    s_frac=st.floats(0, 1),
    prefix=st.integers(0, 3),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_configurations_match_reference(B, H, G, N, D, m, k, s_frac, prefix, masked, seed) -> None:
    prefix = min(prefix, N - 1)
    s = 1 + int(s_frac * (m - 1))
    H = H * G
    case = Case(B=B, H=H, Hkv=H // G, N=N, D=D, m=m, k=k, s=s, prefix=prefix, mask=masked)
    q, k_, v, mask = case.inputs(seed=seed)
    if mask is not None:
        mask[:, : prefix + 1] = True
    ref = mita_attention(q, k_, v, **case.kwargs(mask), impl="reference")
    out = mita_attention(q, k_, v, **case.kwargs(mask))
    assert (out - ref).abs().max().item() <= 1e-10


# Errors ---------------------------------------------------------------------------------

Q = torch.randn(2, 4, 16, 8)
KV = torch.randn(2, 2, 16, 8)
GOOD = dict(num_landmarks=4, topk=4)

ERRORS = {
    "q-rank": (dict(q=Q[0]), ValueError, "q must have shape"),
    "k-shape": (dict(k=torch.randn(2, 2, 16, 4)), ValueError, "k and v must have the same shape"),
    "kv-batch": (dict(k=torch.randn(1, 2, 16, 8), v=torch.randn(1, 2, 16, 8)), ValueError, "k must have shape"),
    "heads": (dict(k=torch.randn(2, 3, 16, 8), v=torch.randn(2, 3, 16, 8)), ValueError, "multiple of the kv heads"),
    "int-dtype": (dict(q=Q.long()), TypeError, "dtype"),
    "mixed-dtype": (dict(q=Q.double()), TypeError, "share one dtype"),
    "not-tensor": (dict(q=[1.0]), TypeError, "must be a torch.Tensor"),
    "empty": (dict(q=Q[:, :, :0], k=KV[:, :, :0], v=KV[:, :, :0]), ValueError, "empty sequence"),
    "m0": (dict(num_landmarks=0), ValueError, "num_landmarks must be an int >= 1"),
    "k0": (dict(topk=0), ValueError, "topk must be an int >= 1"),
    "s0": (dict(num_routed=0), ValueError, "num_routed must be an int in"),
    "s>m": (dict(num_routed=5), ValueError, "num_routed must be an int in"),
    "grid-count": (dict(grid=(3, 3)), ValueError, r"grid=\(3, 3\) holds 9 tokens"),
    "grid-type": (dict(grid=(4,)), ValueError, "grid must be None, a pair"),
    "2d-not-square": (dict(grid=(4, 4), num_landmarks=5), ValueError, "perfect square"),
    "2d-bad-pair": (dict(grid=(4, 4), num_landmarks=(2, 0)), ValueError, "perfect square int or"),
    "prefix": (dict(num_prefix_tokens=16), ValueError, "num_prefix_tokens must be an int in"),
    "mask-dtype": (dict(key_padding_mask=torch.ones(2, 16)), TypeError, "must be a bool tensor"),
    "mask-shape": (dict(key_padding_mask=torch.ones(2, 15, dtype=torch.bool)), ValueError, "must have shape \\(B=2"),
    "mask-empty": (dict(key_padding_mask=torch.zeros(2, 16, dtype=torch.bool)), ValueError, "marks no real token"),
    "landmarks-shape": (dict(landmarks=torch.randn(2, 4, 3, 7)), ValueError, "landmarks must have shape"),
    "landmarks-dtype": (dict(landmarks=torch.randn(2, 4, 3, 8).double()), TypeError, "landmarks must match"),
    "impl": (dict(impl="fast"), ValueError, "impl must be one of"),
    "dropout": (dict(dropout_p=1.5), ValueError, "dropout_p must be a float in"),
    "branches": (dict(branches="none"), ValueError, "branches must be"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_input_errors(name: str) -> None:
    override, exc, message = ERRORS[name]
    args = {"q": Q, "k": KV, "v": KV, **GOOD, **override}
    with pytest.raises(exc, match=message):
        mita_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_prefix_only_real_tokens_error() -> None:
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 2:] = False
    with pytest.raises(ValueError, match="no real query besides the 2 prefix and 0 suffix tokens"):
        mita_attention(Q, KV, KV, **GOOD, num_prefix_tokens=2, key_padding_mask=mask)


def test_2d_bin_without_real_token_error() -> None:
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 8:] = False  # the lower half of a 4x4 grid is padding
    for impl in ("grouped", "reference"):
        with pytest.raises(ValueError, match="pooling bin"):
            mita_attention(Q, KV, KV, num_landmarks=4, topk=4, grid=(4, 4), key_padding_mask=mask, impl=impl)


def test_tensors_on_different_devices_error() -> None:
    with pytest.raises(ValueError, match="one device"):
        mita_attention(Q, KV.to("meta"), KV, **GOOD)


@pytest.mark.parametrize("s", [1, 2])
def test_dropout_gradcheck_and_mean(s: int) -> None:
    q, k, v, mask = Case(B=1, H=2, N=8, D=3, m=3, k=4, s=s, mask=True).inputs()
    opts = dict(num_landmarks=3, topk=4, num_routed=s, key_padding_mask=mask, dropout_p=0.3)

    def fn(*t):
        torch.manual_seed(1)  # the same dropout mask on every call
        return mita_attention(*t, **opts)

    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (q, k, v)], fast_mode=True)
    with torch.no_grad():
        runs = torch.stack([mita_attention(q, k, v, **opts) for _ in range(400)])
        exact = mita_attention(q, k, v, **{**opts, "dropout_p": 0.0})
    stderr = runs.std(0) / 20
    assert ((runs.mean(0) - exact).abs() <= 5 * stderr + 1e-9).all()  # dropout is unbiased
