"""The fused CPU kernel: dispatch, agreement with the grouped path past its block sizes, fallbacks.

(Agreement with the reference, gradcheck, determinism and isolation are in test_mita_op.)"""

from __future__ import annotations

import os

import pytest
import torch

import mita.ops.mita as mita_ops
from mita import mita_attention
from mita.ops.mita import fused
from test_mita_op import Case

# Where a compiler is (CI included), the kernel must build: a failed build fails these tests.
pytestmark = pytest.mark.skipif(os.environ.get("MITA_FUSED") == "0", reason="MITA_FUSED=0 switches the kernel off")


@pytest.fixture
def spy(monkeypatch):
    """Records which implementation each call took."""
    calls: list[str] = []
    for name, fn in list(mita_ops.IMPLEMENTATIONS.items()):
        recorded = lambda *a, _n=name, _f=fn, **kw: calls.append(_n) or _f(*a, **kw)  # noqa: E731
        monkeypatch.setitem(mita_ops.IMPLEMENTATIONS, name, recorded)
    return calls


@pytest.fixture
def fresh_state(monkeypatch):
    """Forget whether the kernel loaded, and restore that afterwards."""
    monkeypatch.setattr(fused, "_state", {})


def test_auto_takes_the_kernel_only_where_it_applies(spy) -> None:
    q, k, v, mask = Case(N=40, m=4, k=6, s=2, mask=True).inputs(dtype=torch.float32)
    opts = dict(num_landmarks=4, topk=6, num_routed=2, key_padding_mask=mask)
    with torch.no_grad():
        mita_attention(q, k, v, **opts)
        mita_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **opts)
        mita_attention(q, k, v, **opts, dropout_p=0.1)
        mita_attention(q, k, v, **opts, branches="shared")
    mita_attention(q.requires_grad_(), k, v, **opts)  # training too
    assert spy == ["fused", "fused", "grouped", "grouped", "fused"]


REFUSED = {"dropout": dict(dropout_p=0.1), "ablation": dict(branches="routed")}


@pytest.mark.parametrize("override", list(REFUSED.values()), ids=list(REFUSED))
def test_fused_refuses_what_it_cannot_do(override: dict) -> None:
    q, k, v, _ = Case(N=20, m=3, k=4).inputs()
    with pytest.raises(ValueError, match=f"impl='fused' cannot run this call: {next(iter(override))}="):
        mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused", **override)


LARGE = [
    Case(B=1, H=2, N=3000, D=32, m=24, k=40, s=1),
    Case(B=2, H=4, Hkv=2, N=1300, D=16, m=20, k=70, s=2, mask=True),
    Case(B=1, H=2, N=600, Nk=1500, D=16, m=10, k=600, s=3, mask=True),
]


@pytest.mark.parametrize("case", LARGE, ids=[str(c) for c in LARGE])
def test_fused_matches_grouped_across_blocks(case: Case) -> None:
    """Outputs and gradients at lengths past the kernel's key (512) and query (256) blocks, masks,
    GQA, cross-attention."""
    q, k, v, mask = case.inputs()
    grad = torch.randn_like(q)
    results = []
    for impl in ("fused", "grouped"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, r = mita_attention(*leaves, **case.kwargs(mask), impl=impl, return_routing=True)
        results.append((out, *torch.autograd.grad(out, leaves, grad), r))
    for a, b in zip(results[0][:4], results[1][:4]):
        assert (a - b).abs().max().item() <= 1e-10
    (r, rr) = results[0][4], results[1][4]
    if mask is None:  # (with padding, routing is compared in test_mita_op)
        assert torch.equal(r.experts, rr.experts) and torch.equal(r.routes, rr.routes)


def test_fused_float32_is_deterministic_and_reads_no_uninitialised_memory() -> None:
    case = Case(B=2, H=2, N=700, D=32, m=16, k=24, s=2, mask=True)
    q, k, v, mask = case.inputs(dtype=torch.float32)
    old = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with torch.no_grad():
            runs = [mita_attention(q, k, v, **case.kwargs(mask), impl="fused") for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(old[0])
        torch.utils.deterministic.fill_uninitialized_memory = old[1]
    assert torch.isfinite(runs[0]).all() and torch.equal(runs[0], runs[1])


def test_switched_off_falls_back_to_grouped(fresh_state, monkeypatch, spy) -> None:
    monkeypatch.setenv("MITA_FUSED", "0")
    q, k, v, _ = Case(N=20, m=3, k=4).inputs()
    with torch.no_grad():
        mita_attention(q, k, v, num_landmarks=3, topk=4)
        with pytest.raises(RuntimeError, match="not available"):
            mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused")
    assert spy == ["grouped", "fused"]


def test_failed_build_warns_once_and_falls_back(fresh_state, monkeypatch, tmp_path) -> None:
    bad = tmp_path / "fused_cpu.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(fused, "SOURCE", bad)
    monkeypatch.setenv("MITA_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert not fused.available()
    assert not fused.available()  # decided once per process


def test_cache_dir_is_keyed_by_torch_capability_and_source(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MITA_CACHE", str(tmp_path))
    d = fused.cache_dir()
    assert d.parent == tmp_path and torch.__version__ in d.name and fused._isa() in d.name


def test_operator_schema_and_fake_kernel() -> None:
    """torch.library's checks: the schema matches what the kernel does, the fake kernel its shapes."""
    q, k, v, mask = Case(B=2, H=2, N=50, D=8, m=4, k=6, s=2, mask=True).inputs(dtype=torch.float32)
    landmarks = torch.randn(2, 2, 4, 8)
    k = k.masked_fill(~mask[:, None, :, None], 0)
    checks = ("test_schema", "test_faketensor")
    args = (q, k, v, landmarks, mask, mask, 6, 2, 0.3, 0.2)
    torch.library.opcheck(torch.ops.mita.fused_forward.default, args, test_utils=checks)
    out, experts, routes, *saved = torch.ops.mita.fused_forward(*args)
    args = (torch.randn_like(q), q, k, v, landmarks, mask, mask, experts, routes, out, *saved, 0.3, 0.2)
    torch.library.opcheck(torch.ops.mita.fused_backward.default, args, test_utils=checks)


def test_traces_under_torch_compile() -> None:
    q, k, v, _ = Case(N=40, m=4, k=6).inputs(dtype=torch.float32)
    fn = lambda q, k, v: mita_attention(q, k, v, num_landmarks=4, topk=6)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fn, backend="eager")(q, k, v), fn(q, k, v))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(fn, backend="aot_eager")(*leaves).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_backward_operator_rejects_bad_saved_tensors() -> None:
    q, k, v, _ = Case(B=1, H=2, N=30, D=8, m=3, k=4).inputs(dtype=torch.float32)
    landmarks = torch.randn(1, 2, 3, 8)
    out, experts, routes, *saved = torch.ops.mita.fused_forward(q, k, v, landmarks, None, None, 4, 1, 0.3, 0.3)
    args = [torch.randn_like(q), q, k, v, landmarks, None, None, experts, routes, out, *saved, 0.3, 0.3]
    with pytest.raises(RuntimeError, match="routes out of range"):
        torch.ops.mita.fused_backward(*args[:8], routes + 3, *args[9:])
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.mita.fused_backward(*args[:9], out[:, :, :-1].contiguous(), *args[10:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_gradients_close_to_float64(dtype: torch.dtype) -> None:
    """Half precision runs the kernels in float32: outputs and gradients in the caller's dtype."""
    case = Case(N=120, D=32, m=8, k=16, s=2, mask=True)
    q, k, v, mask = case.inputs()
    _, routing = mita_attention(q, k, v, **case.kwargs(mask), return_routing=True)
    opts = dict(**case.kwargs(mask), landmarks=routing.landmarks)  # same routing for both
    grads = []
    for leaves in ([t.clone().requires_grad_() for t in (q, k, v)], [t.to(dtype).requires_grad_() for t in (q, k, v)]):
        out = mita_attention(*leaves, **{**opts, "landmarks": opts["landmarks"].to(leaves[0].dtype)}, impl="fused")
        assert out.dtype == leaves[0].dtype
        grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
    for ref, half in zip(*grads):
        assert half.dtype == dtype
        assert ((half.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item() < 0.05
