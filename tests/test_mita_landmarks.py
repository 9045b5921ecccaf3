"""Content landmarks (mita.ops.mita.landmarks): duplicate groups and distinct pooling against the spec's pooling."""

from __future__ import annotations

import pytest
import torch

from mita import mita_attention
from mita.ops.mita.landmarks import distinct_landmarks, duplicate_groups
from mita.ops.pooling import check_pooling, pool


def test_duplicate_groups_by_hand():
    x = torch.tensor([[1.0, 2.0], [3.0, 1.0], [1.0, 2.0], [1.0, 2.0 + 1e-7], [5.0, 5.0], [3.0, 1.0]])[None, None]
    copies, first = duplicate_groups(x)
    assert copies[0, 0].tolist() == [3, 2, 3, 3, 1, 2]
    assert first[0, 0].tolist() == [True, True, False, False, True, False]
    mask = torch.tensor([[True, True, True, True, False, False]])
    copies, first = duplicate_groups(x, mask)
    assert copies[0, 0].tolist() == [3, 1, 3, 3, 1, 1] and first[0, 0].tolist() == [1, 1, 0, 0, 0, 0]
    x[0, 0, 3, 1] = 2.01  # beyond the tolerance: its own group
    assert duplicate_groups(x)[0][0, 0].tolist() == [2, 2, 2, 1, 1, 2]
    # near-equal vectors may sort in either order: the group's first is still its lowest index
    near = torch.tensor([[1.0, 2.0 - 1e-6], [1.0, 2.0], [0.0, 5.0]])[None, None]
    copies, first = duplicate_groups(near)
    assert copies[0, 0].tolist() == [2, 2, 1] and first[0, 0].tolist() == [True, False, True]


def test_duplicate_groups_random_sizes_and_nan_padding():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 5, 4, generator=g)
    pick = torch.randint(0, 5, (2, 3, 40), generator=g)
    x = base.gather(2, pick[..., None].expand(-1, -1, -1, 4))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 30:] = False
    x[1, :, 30:] = float("nan")  # padding holds anything
    copies, first = duplicate_groups(x, mask)
    for b in range(2):
        for h in range(3):
            n = int(mask[b].sum())
            counts = torch.bincount(pick[b, h, :n], minlength=5).float()
            assert torch.equal(copies[b, h, :n], counts[pick[b, h, :n]])
            assert first[b, h, :n].sum() == (counts > 0).sum() and not first[b, h, n:].any()
            for v in pick[b, h, :n].unique():
                assert first[b, h, (pick[b, h, :n] == v).nonzero()[0, 0]]  # the lowest index of each group


@pytest.mark.parametrize(
    "N,m,kwargs",
    [(24, 6, {}), (26, 4, {}), (17, 4, dict(num_prefix_tokens=1)), (40, 4, dict(grid=(6, 6), num_prefix_tokens=4))],
)
def test_distinct_pooling_is_the_spec_without_repeats(N, m, kwargs):
    q = torch.randn(2, 2, N, 8, dtype=torch.float64)
    pooling = check_pooling(m, kwargs.get("grid"), kwargs.get("num_prefix_tokens", 0), N)
    torch.testing.assert_close(distinct_landmarks(q, m, **kwargs), pool(q, pooling))


def test_distinct_pooling_counts_a_repeated_query_once():
    q = torch.randn(1, 1, 16, 4)
    q[0, 0, 4:14] = q[0, 0, 3]  # tokens 3..13 are one query (11 copies)
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, 15] = False
    lm = distinct_landmarks(q, 2, query_padding_mask=mask)  # real tokens 0..14: bins 0..7 and 7..14
    w = torch.ones(15)
    w[3:14] = 1 / 11
    for i, (a, b) in enumerate([(0, 8), (7, 15)]):
        want = (q[0, 0, a:b] * w[a:b, None]).sum(0) / w[a:b].sum()
        torch.testing.assert_close(lm[0, 0, i], want)
    one = q[:, :, 3:14]  # a bin of one repeated token pools to that token
    torch.testing.assert_close(distinct_landmarks(one, 1)[0, 0, 0], q[0, 0, 3])


def test_distinct_landmarks_drive_the_operator_and_carry_gradients():
    q, k, v = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(3))
    lm = distinct_landmarks(q, 4)
    out = mita_attention(q, k, v, num_landmarks=4, topk=6, landmarks=lm, impl="grouped")
    ref = mita_attention(q, k, v, num_landmarks=4, topk=6, impl="grouped")
    torch.testing.assert_close(out, ref)  # random queries: no repeats, the spec's landmarks
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert distinct_landmarks(q.detach().half(), 4).dtype == torch.float16


def test_errors():
    with pytest.raises(ValueError, match=r"\(B, H, N, D\)"):
        duplicate_groups(torch.randn(3, 4))
    with pytest.raises(ValueError, match="mask"):
        duplicate_groups(torch.randn(1, 1, 4, 2), torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(B, H, N, D\)"):
        distinct_landmarks(torch.randn(4, 2), 2)
    with pytest.raises(ValueError, match="num_landmarks"):
        distinct_landmarks(torch.randn(1, 1, 8, 2), 0)
