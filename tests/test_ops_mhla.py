"""MHLA, linear attention over token blocks with mixed summaries (issue 28): efficient path against the
reference on block grids, the closed forms (one block, identity mixing, the authors' cosine mixing), errors,
the layer. Its paths against each other on sequences, padding and gradcheck: ``test_ops_pairs.py``."""

from __future__ import annotations

import math

import pytest
import torch

from _pairs import (
    assert_layer_extras,
    assert_paths_agree,
)
from _zoo import F64, padding, qkv
from mita import attention as registry
from mita.ops.mhla import block_mixing, mhla_attention, mhla_attention_reference

PATHS = [mhla_attention, mhla_attention_reference]


@pytest.mark.parametrize(("grid", "num_blocks", "prefix"), [((4, 4), (2, 2), 1), ((2, 3, 5), 8, 0), ((7, 7), 9, 1)])
@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_grids_match_reference(op, grid, num_blocks, prefix):
    n = prefix + math.prod(grid)
    options = {"num_blocks": num_blocks, "grid": grid, "num_prefix_tokens": prefix}
    assert_paths_agree(mhla_attention, mhla_attention_reference, lambda *_: options, n, n, (4, 2), True)


def _phi(x):
    return torch.relu(x) + 1e-6


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_one_block_is_linear_attention_without_normaliser(op):
    q, k, v = qkv(Nq=11, Nk=11)
    out = op(q, k, v, num_blocks=1, num_prefix_tokens=2)
    G = 2
    torch.testing.assert_close(
        out, _phi(q) @ _phi(k).repeat_interleave(G, 1).transpose(-1, -2) @ v.repeat_interleave(G, 1)
    )


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_identity_mixing_is_attention_within_blocks(op):
    """M = I: each query reads its own block only; blocks are runs of consecutive tokens (12 tokens, 3 blocks)."""
    q, k, v = qkv(H=2, Hkv=2, Nq=12, Nk=12)
    out = op(q, k, v, num_blocks=3, mixing=torch.eye(3, dtype=F64))
    block = torch.arange(12) // 4
    A = (_phi(q) @ _phi(k).transpose(-1, -2)) * (block[:, None] == block)
    torch.testing.assert_close(out, A @ v)


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_identity_mixing_on_a_grid_is_attention_within_windows(op):
    """On a (4, 6) grid with (2, 3) blocks a block is a 2 x 2 window of rows and columns (the authors' layout);
    the prefix token reads and is read by everything."""
    q, k, v = qkv(H=2, Hkv=2, Nq=25, Nk=25)
    out = op(q, k, v, num_blocks=(2, 3), grid=(4, 6), num_prefix_tokens=1, mixing=torch.eye(6, dtype=F64))
    y, x = torch.arange(24) // 6, torch.arange(24) % 6
    block = torch.cat([torch.tensor([-1]), (y // 2) * 3 + x // 2])
    same = (block[:, None] == block) | (block[:, None] == -1) | (block == -1)
    A = (_phi(q) @ _phi(k).transpose(-1, -2)) * same
    torch.testing.assert_close(out, A @ v)


def test_cosine_mixing_is_the_authors():
    """cos(pi/4 d / max d), d between block centres, each column normalised to sum 1; one block: [[1]]."""
    m = block_mixing((2, 2), dtype=F64)
    d = torch.tensor([[0, 1, 1, 2**0.5], [1, 0, 2**0.5, 1], [1, 2**0.5, 0, 1], [2**0.5, 1, 1, 0]], dtype=F64)
    c = torch.cos(d / 2**0.5 * math.pi / 4)
    torch.testing.assert_close(m, c / c.sum(0))
    torch.testing.assert_close(block_mixing((1,), dtype=F64), torch.ones(1, 1, dtype=F64))
    torch.testing.assert_close(block_mixing((4, 4)).sum(0), torch.ones(16))


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"dropout_p": 0.1}, ValueError, "dropout_p"),
        ({"num_blocks": 0}, ValueError, "num_blocks must be an int >= 1"),
        ({"num_blocks": 3, "grid": (2, 3)}, ValueError, r"grid=.* holds 6 tokens"),
        ({"num_blocks": 3, "grid": (1, 7)}, ValueError, "num_blocks=3 with a 2-D grid must be a perfect square"),
        ({"num_blocks": 2, "mixing": torch.eye(3, dtype=F64)}, ValueError, r"mixing must have shape \(m=2, m=2\)"),
        ({"num_blocks": 2, "mixing": "eye"}, TypeError, "mixing"),
        ({"num_blocks": 2, "num_prefix_tokens": 7}, ValueError, "num_prefix_tokens"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        mhla_attention(q, k, v, **options)


def test_cross_attention_on_a_grid_needs_both_sides_on_it():
    q, k, v = qkv(Nq=16, Nk=9)
    with pytest.raises(ValueError, match=r"grid=.* holds 16 tokens but the sequence has"):
        mhla_attention(q, k, v, num_blocks=4, grid=(4, 4))


def test_layer_learns_its_mixing():
    layer = registry.build_layer("mhla:grid='auto',num_prefix_tokens=1,num_blocks=4", 32, 4)
    torch.testing.assert_close(layer.mixing.weight.detach(), block_mixing((2, 2)))
    x = torch.randn(2, 17, 32)
    mask = padding(2, 17, [17, 12])
    out = layer(x, attn_mask=mask)
    out.square().sum().backward()
    assert layer.mixing.weight.grad.abs().sum() > 0
    assert (out[1, 12:] == layer.proj.bias).all()


def test_layer_adds_only_its_mixing():
    assert_layer_extras("mhla", {}, {"mixing"})


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"grid": "auto", "num_blocks": 5}, "perfect square"),
        ({"grid": (0, 2)}, "grid"),
    ],
)
def test_layer_errors(options, match):
    with pytest.raises(ValueError, match=match):
        registry.build_layer({"name": "mhla", **options}, 32, 4)
