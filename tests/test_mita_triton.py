"""The Triton kernels (impl="triton") against the reference, outputs and gradients.

Without a GPU they run in Triton's interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before Triton is imported), with 16-row tiles so that small shapes
reach every tile edge; with a GPU the same cases run the compiled kernels on CUDA.
The interpreter computes bfloat16 ``tl.dot`` wrongly (triton issue 11584), so bfloat16 is
checked on GPUs only.
"""

from __future__ import annotations

import pytest
import torch

from mita.ops.mita import mita_attention
from mita.ops.mita import triton as mita_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not mita_triton.available() or (DEVICE == "cpu" and not mita_triton.interpreting()),
    reason="needs triton, and TRITON_INTERPRET=1 without a GPU",
)

# name: (B, H, Hkv, Nq, Nk, D, call options)
CASES = {
    "empty_experts": (1, 2, 2, 5, 9, 16, {"num_landmarks": 8, "topk": 3, "landmarks": True}),
    "expert_over_a_tile": (1, 2, 1, 70, 70, 16, {"num_landmarks": 2, "topk": 4}),
    "odd_lengths_k19": (2, 2, 2, 37, 29, 24, {"num_landmarks": 3, "topk": 19}),
    "s2_gqa_m20": (1, 4, 2, 33, 33, 16, {"num_landmarks": 20, "topk": 6, "num_routed": 2}),
    "s3_key_mask_short": (2, 2, 1, 30, 30, 16, {"num_landmarks": 4, "topk": 12, "num_routed": 3, "key_mask": 9}),
    "cross_both_masks": (2, 2, 2, 21, 34, 16, {"num_landmarks": 3, "topk": 5, "key_mask": 20, "query_mask": 15}),
    "grid3d_prefix": (1, 2, 2, 2 + 2 * 3 * 4, 2 + 2 * 3 * 4, 16, {"grid": (2, 3, 4), "num_prefix_tokens": 2,
                                                                   "num_landmarks": (1, 2, 2), "topk": 7}),
    "grid2d_prefix_suffix": (1, 2, 2, 1 + 3 * 4 + 4, 1 + 3 * 4 + 4, 16, {"grid": (3, 4), "num_prefix_tokens": 1,
                                                                       "num_suffix_tokens": 4, "num_landmarks": 4,
                                                                       "topk": 6}),
}  # fmt: skip


def _run(case: str, dtype: torch.dtype, impl: str, inputs=None):
    B, H, Hkv, Nq, Nk, D, opts = CASES[case]
    opts = dict(opts)
    gen = torch.Generator().manual_seed(0)
    if inputs is None:
        shapes = [(B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)]
        if opts.get("landmarks"):
            shapes.append((B, H, opts["num_landmarks"], D))
        inputs = [torch.randn(s, generator=gen).to(DEVICE, dtype).requires_grad_() for s in shapes]
    kw = {key: val for key, val in opts.items() if key not in ("key_mask", "query_mask", "landmarks")}
    if "key_mask" in opts:  # the second sequence keeps its first n keys
        kw["key_padding_mask"] = torch.ones(B, Nk, dtype=torch.bool, device=DEVICE)
        kw["key_padding_mask"][-1, opts["key_mask"] :] = False
    if "query_mask" in opts:
        kw["query_padding_mask"] = torch.ones(B, Nq, dtype=torch.bool, device=DEVICE)
        kw["query_padding_mask"][-1, opts["query_mask"] :] = False
    if opts.get("landmarks"):
        kw["landmarks"] = inputs[3]
    out = mita_attention(*inputs[:3], impl=impl, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    return inputs, (out, *torch.autograd.grad(out, inputs, dout))


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("case", list(CASES))
def test_triton_float32_matches_reference(case: str) -> None:
    inputs, got = _run(case, torch.float32, "triton")
    _, want = _run(case, torch.float32, "reference", [x.detach().clone().requires_grad_() for x in inputs])
    for name, g, w in zip(["out", "dq", "dk", "dv", "dlandmarks"], got, want):
        assert _rel_rms(g, w) <= 1e-5, (name, _rel_rms(g, w))


@pytest.mark.parametrize("case", ["odd_lengths_k19", "s3_key_mask_short", "cross_both_masks"])
def test_triton_split_k_matches_reference(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared-expert products cut into pieces of 8 keys (a GPU's long sequences) change nothing."""
    monkeypatch.setattr(mita_triton, "SPLIT_K", 8)
    test_triton_float32_matches_reference(case)


@pytest.mark.parametrize("case", ["s2_gqa_m20", "cross_both_masks"])
def test_triton_float16_within_rounding(case: str) -> None:
    """Half inputs: the error against the float64 reference is that of the grouped path, or float16 rounding (1e-3)."""
    inputs, got = _run(case, torch.float16, "triton")
    exact = [x.detach().double().requires_grad_() for x in inputs]
    _, want = _run(case, torch.float64, "reference", exact)
    _, grouped = _run(case, torch.float16, "grouped", [x.detach().clone().requires_grad_() for x in inputs])
    for name, g, w, p in zip(["out", "dq", "dk", "dv"], got, want, grouped):
        assert g.dtype == torch.float16
        assert _rel_rms(g, w) <= max(1e-3, 1.5 * _rel_rms(p, w)), (name, _rel_rms(g, w), _rel_rms(p, w))


@pytest.mark.parametrize("K", [7, 16, 40, 43])
def test_split_k_matmul_is_the_product(K: int) -> None:
    """The shared-expert products cut along K (pieces of 8 here): values and float64 gradients of a @ b."""
    a = torch.randn(2, 3, 5, K, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, K, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(mita_triton.split_k_matmul(a, b, 8), a @ b)
    assert torch.autograd.gradcheck(lambda x, y: mita_triton.SplitK.apply(x, y, 8), (a, b))
    # the landmarks' side: a long output dimension, whose gradient for a is the long reduction
    bt = torch.randn(2, 3, 4, K, dtype=torch.float64, requires_grad=True)
    a4 = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: mita_triton.SplitK.apply(x, y, 8), (a4, bt))


def test_triton_rejects_what_it_cannot_run() -> None:
    q = torch.randn(1, 1, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_p"):
        mita_attention(q, q, q, num_landmarks=2, topk=2, dropout_p=0.1, impl="triton")
    with pytest.raises(ValueError, match="branches"):
        mita_attention(q, q, q, num_landmarks=2, topk=2, branches="shared", impl="triton")
    big = torch.randn(1, 1, 4, 512, device=DEVICE)
    with pytest.raises(ValueError, match="head dim D=512"):
        mita_attention(big, big, big, num_landmarks=2, topk=2, impl="triton")


def test_triton_compiles_whole_and_matches_eager() -> None:
    """torch.compile(fullgraph=True) traces the custom ops (forward and backward) without a graph break."""

    def f(q, k, v, mask):
        return mita_attention(q, k, v, num_landmarks=3, topk=5, num_routed=2, key_padding_mask=mask, impl="triton")

    q, k, v = (torch.randn(2, h, 30, 16, device=DEVICE, requires_grad=True) for h in (4, 2, 2))
    mask = torch.ones(2, 30, dtype=torch.bool, device=DEVICE)
    mask[1, 23:] = False
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = f(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got, want)
