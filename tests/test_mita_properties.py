"""A property over mita_attention's arguments: every call agrees across the paths, or is refused clearly.

The draws reach the edges: logits up to ~1e16 and scales from 1e-30 to 1e30 (a one-hot or a uniform
softmax), repeated keys (exact top-k ties, broken by the lower index on every path), prefix and suffix
tokens, padding, grids and invalid values of every option.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mita import mita_attention

IMPLS = ("reference", "grouped", "fused")


@st.composite
def calls(draw):
    """Arguments of one call: mostly valid, sometimes not (bad m, k, s, grids, scales, masks)."""
    B, Hkv = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    H = Hkv * draw(st.sampled_from([1, 2]))
    Nq = draw(st.integers(1, 20))
    Nk = Nq if draw(st.booleans()) else draw(st.integers(1, 20))
    D = draw(st.sampled_from([1, 3, 8]))
    sane = draw(st.integers(0, 3)) > 0  # three calls in four draw from the valid ranges
    prefix = draw(st.integers(0, min(3, Nq - 1) if sane else 3))
    suffix = draw(st.integers(0, min(2, Nq - 1 - prefix) if sane and Nq > prefix else 2))
    pooled = Nq - prefix - suffix
    grid, m = None, draw(st.integers(1 if sane else -1, 7))
    kind = draw(st.sampled_from(["1d", "2d", "3d", "bad-grid"]))
    if kind == "2d" and pooled > 0:
        gh = draw(st.sampled_from([d for d in range(1, pooled + 1) if pooled % d == 0]))
        grid, m = (gh, pooled // gh), draw(st.sampled_from([1, 4, (1, 2), (2, 2), 3]))
    elif kind == "3d" and pooled > 0:
        gt = draw(st.sampled_from([d for d in range(1, pooled + 1) if pooled % d == 0]))
        gh = draw(st.sampled_from([d for d in range(1, pooled // gt + 1) if (pooled // gt) % d == 0]))
        grid, m = (gt, gh, pooled // gt // gh), draw(st.sampled_from([1, 8, (1, 1, 2), (2, 1, 1), 4]))
    elif kind == "bad-grid":
        grid = draw(st.sampled_from([(2,), (0, 3), (True, 2), (2, 2, 2, 2), "auto", (1.5, 2)]))
    mask = lambda n: torch.rand(B, n, generator=gen) > draw(st.sampled_from([0.0, 0.3, 0.7]))  # noqa: E731
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    # Extreme draws (logits up to ~1e16, or scales of 1e+-30) or repeated keys, not both: at such scales a
    # rounding difference between two equal logits decides the softmax, and no path is wrong.
    extreme = sane and draw(st.booleans())
    size = draw(st.sampled_from([1.0, 1e4, 1e8])) if extreme else 1.0  # of q and k
    k = size * torch.randn(B, Hkv, Nk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, Nk, D, generator=gen, dtype=torch.float64)
    if not extreme and Nk > 2 and draw(st.booleans()):  # a run of identical keys: ties in the top-k
        # Values copied too: identical keys' affinities can differ by an ulp where a BLAS rounds one
        # output column differently (float64, dgemm's tail: a different key of the run won the top-1),
        # so which copy a path takes must not matter; exact ties: test_mita_fused's tie test.
        a = draw(st.integers(0, Nk - 2))
        b = draw(st.integers(a + 2, Nk))
        k[:, :, a:b], v[:, :, a:b] = k[:, :, a : a + 1].clone(), v[:, :, a : a + 1].clone()
    args = dict(
        q=size * torch.randn(B, H, Nq, D, generator=gen, dtype=torch.float64),
        k=k,
        v=v,
        num_landmarks=m,
        topk=draw(st.integers(1 if sane else -1, 25)),
        num_routed=draw(st.integers(1, 2) if sane else st.integers(0, 4)),
        grid=grid,
        num_prefix_tokens=prefix,
        num_suffix_tokens=suffix,
        key_padding_mask=mask(Nk) if draw(st.booleans()) else None,
        query_padding_mask=mask(Nq) if draw(st.booleans()) else None,
        scale=draw(
            st.sampled_from(
                ([None, 1e-30, 1e30] if extreme else [None, 0.3, 2.0])
                if sane
                else [0.0, -1.0, math.nan, math.inf, 1e-320]
            )
        ),
        landmark_scale=draw(
            st.sampled_from(([None, 1e30] if extreme else [None, 0.5]) if sane else [None, 0.0, "1", 1e309])
        ),
    )
    return args


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_every_call_agrees_across_paths_or_is_refused(args) -> None:
    results = {}
    for impl in IMPLS:
        try:
            results[impl] = mita_attention(**args, impl=impl)
        except (ValueError, TypeError) as err:
            results[impl] = type(err)
    kinds = {impl: r if isinstance(r, type) else "ok" for impl, r in results.items()}
    assert len(set(kinds.values())) == 1, kinds  # all refuse alike, or all compute
    if kinds["reference"] == "ok":
        ref = results["reference"]
        assert torch.isfinite(ref).all()
        for impl in IMPLS[1:]:
            torch.testing.assert_close(results[impl], ref, rtol=1e-8, atol=1e-10)
