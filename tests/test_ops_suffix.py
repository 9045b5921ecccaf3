"""Suffix tokens (ViT-5's registers at the end): they attend but are not pooled, on every path.

The closed form: the tokens are a set to attention (keys in any order give the same softmax),
so an op called with ``num_suffix_tokens=s`` must equal the same op on the sequence with those
s tokens moved to the front and passed as prefix tokens, the outputs moved back.
"""

from __future__ import annotations

import pytest
import torch

from mita.ops.agent import agent_attention, agent_attention_reference
from mita.ops.mhla import mhla_attention, mhla_attention_reference
from mita.ops.mita import mita_attention
from mita.ops.pooling import check_pooling, pool, pool_bins, pool_reference

MITA_IMPLS = ["reference", "grouped", "fused"]


def _front(x: torch.Tensor, s: int) -> torch.Tensor:
    """The last s tokens (dim 2) moved to the front."""
    return torch.cat([x[:, :, -s:], x[:, :, :-s]], 2)


def _back(x: torch.Tensor, s: int) -> torch.Tensor:
    return torch.cat([x[:, :, s:], x[:, :, :s]], 2)


def _qkv(B=2, H=2, Hkv=1, N=1 + 12 + 3, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, N, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv))


@pytest.mark.parametrize("impl", MITA_IMPLS)
@pytest.mark.parametrize("grid", [None, (3, 4)], ids=["1d", "2d"])
def test_mita_suffix_is_prefix_moved(impl: str, grid) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    opts = dict(num_landmarks=4, topk=5, num_routed=2, grid=grid, impl=impl)
    out = mita_attention(q, k, v, num_prefix_tokens=1, num_suffix_tokens=3, **opts)
    moved = mita_attention(*(_front(t, 3) for t in (q, k, v)), num_prefix_tokens=4, **opts)
    torch.testing.assert_close(out, _back(moved, 3))
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_moved = torch.autograd.grad(_back(moved, 3).square().sum(), (q, k, v))
    for a, b in zip(g, g_moved):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("impl", ["grouped", "fused"])
def test_mita_suffix_masked_against_reference(impl: str) -> None:
    q, k, v = _qkv(N=2 + 9 + 2)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, 7:] = False  # the second sequence's suffix (and some patches) padded
    opts = dict(num_landmarks=4, topk=4, grid=(3, 3), num_prefix_tokens=2, num_suffix_tokens=2)
    want = mita_attention(q, k, v, key_padding_mask=mask, impl="reference", **opts)
    torch.testing.assert_close(mita_attention(q, k, v, key_padding_mask=mask, impl=impl, **opts), want)


@pytest.mark.parametrize("op", [agent_attention, agent_attention_reference], ids=["agent", "agent_reference"])
def test_agent_suffix_is_prefix_moved(op) -> None:
    q, k, v = _qkv()
    out = op(q, k, v, num_agents=4, grid=(3, 4), num_prefix_tokens=1, num_suffix_tokens=3)
    moved = op(*(_front(t, 3) for t in (q, k, v)), num_agents=4, grid=(3, 4), num_prefix_tokens=4)
    torch.testing.assert_close(out, _back(moved, 3))


@pytest.mark.parametrize("grid", [None, (3, 4)], ids=["1d", "2d"])
def test_mhla_suffix_against_reference_and_moved(grid) -> None:
    q, k, v = _qkv()
    opts = dict(num_blocks=4, grid=grid, num_prefix_tokens=1, num_suffix_tokens=3)
    out = mhla_attention(q, k, v, **opts)
    torch.testing.assert_close(out, mhla_attention_reference(q, k, v, **opts))
    moved = mhla_attention(*(_front(t, 3) for t in (q, k, v)), num_blocks=4, grid=grid, num_prefix_tokens=4)
    torch.testing.assert_close(out, _back(moved, 3))


def test_pooling_skips_the_suffix() -> None:
    x = torch.randn(2, 1, 1 + 6 + 2, 3)
    p = check_pooling(3, None, 1, 9, num_suffix_tokens=2)
    want = x[:, :, 1:7].unflatten(2, (3, 2)).mean(3)
    torch.testing.assert_close(pool(x, p), want)
    torch.testing.assert_close(pool_reference(x, p), want)
    offsets, tokens = pool_bins(p, 9)
    assert offsets.tolist() == [0, 2, 4, 6] and tokens.tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_suffix_tokens=-1), "num_suffix_tokens must be an int in \\[0, 15\\]"),
        (dict(num_prefix_tokens=10, num_suffix_tokens=6), "num_suffix_tokens must be an int in \\[0, 5\\]"),
        (dict(num_suffix_tokens=2, grid=(3, 4)), "N - num_prefix_tokens - num_suffix_tokens = 14"),
    ],
)
def test_suffix_errors(kwargs: dict, match: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        mita_attention(q, k, v, num_landmarks=4, topk=3, **kwargs)
