"""The CUDA paths without a GPU: traced with fake tensors, and compiled whole.

Under ``FakeTensorMode`` every op runs on shapes alone, so any value read back to the host
(``.item()``, ``int(t)``, ``nonzero``, a data-dependent size) raises: passing these tests
means no host synchronisation. The autograd engine needs a real CUDA context to run a
backward on fake CUDA tensors (pytorch issue 92627), so without a GPU the backward is
traced on fake CPU tensors, through the same no-sync code (fake tensors are never
host-readable); with a GPU it is traced on fake CUDA tensors too.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mita.ops.mita import mita_attention

CUDA_IMPLS = ["auto", "grouped"]
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
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
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
