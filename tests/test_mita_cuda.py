"""The CUDA paths without a GPU: traced with fake tensors, and compiled whole.

Under ``FakeTensorMode`` every op runs on shapes alone, so any value read back to the host
(``.item()``, ``int(t)``, ``nonzero``, a data-dependent size) raises: passing these tests
means no host synchronisation. The autograd engine needs a real CUDA context to run a
backward on fake CUDA tensors (pytorch issue 92627), so without a GPU the backward is
traced on fake CPU tensors, through the same no-sync code (fake tensors are never
host-readable); with a GPU it is traced on fake CUDA tensors too (and the Triton path on CUDA
only: outside the interpreter its kernels take no CPU tensors).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mita.ops.mita import mita_attention

CUDA_IMPLS = ["auto", "grouped", "triton"]
CASES = {  # name: (Nq, Nk, H, Hkv, call options)
    "plain": (40, 40, 4, 4, {}),
    "s2_gqa_masks": (37, 37, 4, 2, {"num_routed": 2, "key_mask": True}),
    "cross_both_masks": (24, 33, 2, 1, {"key_mask": True, "query_mask": True}),
    "grid2d_prefix": (1 + 36, 1 + 36, 2, 2, {"grid": (6, 6), "num_prefix_tokens": 1, "num_landmarks": 4}),
    "grid3d": (2 * 4 * 4, 2 * 4 * 4, 2, 2, {"grid": (2, 4, 4), "num_landmarks": (1, 2, 2), "key_mask": True}),
}


def _call(case: str, device: str, dtype: torch.dtype, impl: str, grad: bool):
    Nq, Nk, H, Hkv, opts = CASES[case]
    opts = dict(opts)
    B, D = 2, 32
    q = torch.randn(B, H, Nq, D, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, Hkv, Nk, D, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, Hkv, Nk, D, device=device, dtype=dtype, requires_grad=grad)
    kw = {"num_landmarks": opts.pop("num_landmarks", 4), "topk": 6, **opts}
    if kw.pop("key_mask", False):
        kw["key_padding_mask"] = torch.ones(B, Nk, dtype=torch.bool, device=device)
    if kw.pop("query_mask", False):
        kw["query_padding_mask"] = torch.ones(B, Nq, dtype=torch.bool, device=device)
    out = mita_attention(q, k, v, impl=impl, **kw)
    return (q, k, v), out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_fake_cuda_forward(impl: str, case: str) -> None:
    with FakeTensorMode():
        (q, _, _), out = _call(case, "cuda", torch.bfloat16, impl, grad=False)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", CUDA_IMPLS)
def test_fake_backward(impl: str, case: str) -> None:
    from mita.ops.mita import triton as mita_triton

    devices = ["cuda"] if torch.cuda.is_available() else []
    if impl != "triton" or mita_triton.interpreting():  # Triton on CPU tensors only in its interpreter
        devices.insert(0, "cpu")
    for device in devices:
        with FakeTensorMode():
            inputs, out = _call(case, device, torch.bfloat16, "grouped" if impl == "auto" else impl, grad=True)
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        for x, g in zip(inputs, grads):
            assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device


def test_compile_fullgraph_grouped() -> None:
    """The grouped path compiles whole (no graph break), forward and backward, and matches eager."""

    def f(q, k, v, mask):
        return mita_attention(q, k, v, num_landmarks=4, topk=5, num_routed=2, key_padding_mask=mask, impl="grouped")

    q, k, v = (torch.randn(2, h, 30, 16, requires_grad=True) for h in (4, 2, 2))
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 23:] = False
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = f(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA code generation needs a GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inductor_compiles_triton_path_on_cuda(mode: str) -> None:
    """torch.compile with inductor (and its CUDA graphs) compiles the Triton path and matches eager.

    On an H200 inductor once failed here: it computed the top-k keys' index arithmetic in int32
    and 2**32 - 1 overflowed (``topk_indices`` now keeps its constants below N). float32 inputs, so
    that no routing choice sits within rounding of a tie.
    """

    def f(q, k, v):
        return mita_attention(q, k, v, num_landmarks=8, topk=16, impl="triton")

    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", requires_grad=True) for _ in range(3))
    compiled = torch.compile(f, mode=mode, fullgraph=True, dynamic=False)
    for _ in range(3):  # CUDA graphs are recorded after warm-up calls
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = f(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


def test_auto_takes_triton_on_cuda_and_falls_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto picks the Triton kernels for CUDA tensors; a head dim they lack falls back with one warning."""
    from mita.ops.mita import triton as mita_triton

    calls = []
    monkeypatch.setattr(mita_triton, "available", lambda: True)
    real = torch.ops.mita.triton_forward
    monkeypatch.setattr(torch.ops.mita, "triton_forward", lambda *a: calls.append(1) or real(*a), raising=False)
    monkeypatch.setattr(mita_triton, "_warned", set())
    with FakeTensorMode():
        q = torch.randn(1, 2, 16, 32, device="cuda", dtype=torch.bfloat16)
        mita_attention(q, q, q, num_landmarks=2, topk=3)
        assert calls == [1]
        big = torch.randn(1, 2, 16, 512, device="cuda", dtype=torch.bfloat16)
        with pytest.warns(RuntimeWarning, match="head dim D=512"):
            out = mita_attention(big, big, big, num_landmarks=2, topk=3)
        assert out.shape == big.shape and calls == [1]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mita_attention(big, big, big, num_landmarks=2, topk=3)
