"""Bidirectional native sparse attention (issue 28): empty blocks selected with weight zero, the branches
written out loop by loop (GQA-shared selection included), the closed forms, errors, the layer. Its paths
against each other, padding and gradcheck: ``test_ops_pairs.py``."""

from __future__ import annotations

import pytest
import torch

from _pairs import (
    assert_layer_extras,
)
from _zoo import F64, dense, padding, qkv
from mita import attention as registry
from mita.ops.nsa import block_means, key_blocks, nsa_attention, nsa_attention_reference
from test_ops_padding import _check_padding_is_inert

PATHS = [nsa_attention, nsa_attention_reference]
SMALL = {"block_size": 4, "topk": 2, "window": 3}


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_padded_blocks_are_selectable_with_weight_zero(op, tensor):
    """More blocks selected than hold a real key: empty blocks are picked last and take no part."""
    _check_padding_is_inert(op, tensor, float("nan"), 2, 33, 33, {"block_size": 2, "topk": 30, "window": 1})


def _written_out(q, k, v, real, block_size, topk, window, gates):
    """NSA query by query: block means, the group's summed compressed probabilities pick its blocks, windows."""
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    G, s = H // Hkv, D**-0.5
    out = torch.zeros_like(q)
    blocks = [list(range(a, min(a + block_size, N))) for a in range(0, N, block_size)]

    def attend(qv, keys, b, h):
        keys = [j for j in keys if real[b, j]]
        if not keys:
            return torch.zeros(D, dtype=q.dtype)
        p = torch.softmax(s * k[b, h // G, keys] @ qv, 0)
        return p @ v[b, h // G, keys]

    for b in range(B):
        valid = [blk for blk in blocks if any(real[b, j] for j in blk)]
        for g in range(Hkv):
            means = torch.stack([k[b, g, [j for j in blk if real[b, j]]].mean(0) for blk in valid])
            vmeans = torch.stack([v[b, g, [j for j in blk if real[b, j]]].mean(0) for blk in valid])
            for i in range(N):
                heads = range(g * G, (g + 1) * G)
                probs = {h: torch.softmax(s * means @ q[b, h, i], 0) for h in heads}
                importance = sum(probs.values())
                chosen = [valid[c] for c in importance.argsort(descending=True)[:topk].tolist()]
                for h in heads:
                    cmp = probs[h] @ vmeans
                    slc = attend(q[b, h, i], sorted(j for blk in chosen for j in blk), b, h)
                    win = attend(q[b, h, i], [j for j in range(N) if abs(i - j) <= window], b, h)
                    out[b, h, i] = gates[b, h, i] @ torch.stack([cmp, slc, win])
    return out.masked_fill(~real[:, None, :, None], 0)


@pytest.mark.parametrize(("block_size", "topk", "window"), [(4, 2, 3), (3, 1, 0), (5, 3, 20)])
def test_branches_written_out(block_size, topk, window):
    q, k, v = qkv(B=2, H=4, Hkv=2, Nq=13, Nk=13)
    real = padding(2, 13, [13, 10])
    gates = torch.rand(2, 4, 13, 3, dtype=F64)
    options = {"block_size": block_size, "topk": topk, "window": window, "gates": gates}
    want = _written_out(q, k, v, real, block_size, topk, window, gates)
    for op in PATHS:
        torch.testing.assert_close(op(q, k, v, key_padding_mask=real, **options), want)


@pytest.mark.parametrize("branch", range(3), ids=["compressed", "selected", "window"])
@pytest.mark.parametrize("groups", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_every_branch_covering_the_sequence_is_softmax_attention(op, groups, branch):
    """Blocks of one key, every block selected, a window over the whole sequence: each branch is softmax
    attention; with all gates 1 the output is three times it."""
    q, k, v = qkv(H=groups[0], Hkv=groups[1], Nq=19, Nk=19)
    mask = padding(2, 19, [19, 12])
    gates = torch.zeros(3, dtype=F64)
    gates[branch] = 1
    covering = {"block_size": 1, "topk": 19, "window": 18}
    torch.testing.assert_close(op(q, k, v, key_padding_mask=mask, gates=gates, **covering), dense(q, k, v, mask))
    torch.testing.assert_close(op(q, k, v, key_padding_mask=mask, **covering), 3 * dense(q, k, v, mask))


@pytest.mark.parametrize("block_size", [3, 8, 19, 40])
def test_selected_and_window_branches_over_everything_for_any_block_size(block_size):
    q, k, v = qkv(Nq=19, Nk=19)
    mask = padding(2, 19, [19, 15])
    out = nsa_attention(
        q,
        k,
        v,
        key_padding_mask=mask,
        block_size=block_size,
        topk=19,
        window=19,
        gates=torch.tensor([0.0, 0.5, 0.5], dtype=F64),
    )
    torch.testing.assert_close(out, dense(q, k, v, mask))


def test_a_window_of_padded_keys_only_reads_nothing():
    """Cross-attention: a real query whose window holds only padded keys gets nothing from that branch."""
    q, k, v = qkv(B=1, H=2, Hkv=2, Nq=6, Nk=6)
    keys = torch.tensor([[True, True, False, False, False, False]])
    queries = torch.ones(1, 6, dtype=torch.bool)
    for op in PATHS:
        out = op(
            q,
            k,
            v,
            key_padding_mask=keys,
            query_padding_mask=queries,
            window=1,
            gates=torch.tensor([0.0, 0.0, 1.0], dtype=F64),
        )
        assert (out[:, :, 3:] == 0).all() and (out[:, :, :3] != 0).any()


def test_dropout_drops_branch_probabilities():
    q, k, v = qkv(Nq=16, Nk=16)
    assert not torch.allclose(nsa_attention(q, k, v, dropout_p=0.5, **SMALL), nsa_attention(q, k, v, **SMALL))


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size must be an int >= 1"),
        ({"topk": 0}, ValueError, "topk must be an int >= 1"),
        ({"window": -1}, ValueError, "window must be an int >= 0"),
        ({"gates": torch.ones(2, 4, 7, 2, dtype=F64)}, ValueError, r"gates of shape \(2, 4, 7, 2\) must broadcast"),
        ({"gates": [1.0, 1.0, 1.0]}, TypeError, "gates must be a float tensor"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be an int >= 1"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"scale": -1.0}, ValueError, "scale"),
        ({"block_size": 4, "compressed": torch.ones(2, 2, 4, 8)}, TypeError, "compressed must be a pair"),
        (
            {"block_size": 4, "compressed": (torch.ones(2, 2, 3, 8, dtype=F64),) * 2},
            ValueError,
            r"compressed k_cmp must be .* = \(2, 2, 2, 8\)",
        ),
        (
            {"block_size": 4, "compressed": (torch.ones(2, 2, 2, 8, dtype=F64), None)},
            ValueError,
            "compressed v_cmp must be",
        ),
        ({"block_size": 4, "compressed": (torch.ones(2, 2, 2, 8),) * 2}, ValueError, "of k's dtype and device"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    q, k, v = qkv(Nq=7, Nk=7)
    with pytest.raises(error, match=match):
        nsa_attention(q, k, v, **options)


@pytest.mark.parametrize("op", PATHS, ids=["fast", "ref"])
def test_given_block_means_are_the_default_and_other_tokens_change_only_the_compressed_branch(op):
    q, k, v = qkv(Nq=13, Nk=13)
    mask = padding(2, 13, [13, 9])
    real = mask
    means = tuple(block_means(*key_blocks(t.masked_fill(~real[:, None, :, None], 0), real, 4)) for t in (k, v))
    torch.testing.assert_close(
        op(q, k, v, key_padding_mask=mask, compressed=means, **SMALL), op(q, k, v, key_padding_mask=mask, **SMALL)
    )
    other = (means[0], means[1] + 1.0)  # values moved by 1: only the compressed branch's output moves, by g_cmp
    gates = torch.tensor([0.5, 1.0, 1.0], dtype=F64)
    moved = op(q, k, v, key_padding_mask=mask, compressed=other, gates=gates, **SMALL)
    base = op(q, k, v, key_padding_mask=mask, compressed=means, gates=gates, **SMALL)
    torch.testing.assert_close(moved - base, 0.5 * mask[:, None, :, None].to(F64).expand_as(base))


def test_key_blocks_pad_the_last_block_and_mark_real_slots():
    t = torch.arange(2 * 1 * 5 * 2, dtype=F64).view(2, 1, 5, 2)
    real = padding(2, 5, [5, 3])
    blocks, slots = key_blocks(t, real, 2)
    assert blocks.shape == (2, 1, 3, 2, 2) and slots.shape == (2, 3, 2)
    assert (blocks[:, :, 2, 1] == 0).all() and slots[0].tolist() == [[True, True], [True, True], [True, False]]
    assert slots[1].tolist() == [[True, True], [True, False], [False, False]]
    torch.testing.assert_close(block_means(blocks * slots[:, None, :, :, None], slots)[1, 0, 1], t[1, 0, 2])


def test_layer_gates_come_from_the_input():
    layer = registry.build_layer("nsa:block_size=4,topk=2,window=3", 32, 4)
    x = torch.randn(2, 17, 32)
    mask = padding(2, 17, [17, 12])
    out = layer(x, attn_mask=mask)
    out.square().sum().backward()
    assert layer.gate_proj.weight.grad.abs().sum() > 0
    assert (out[1, 12:] == layer.proj.bias).all()
    with torch.no_grad():  # gates of 1/2 everywhere: the op with gates 1/2
        layer.gate_proj.weight.zero_()
        layer.gate_proj.bias.zero_()
        B, N, C = x.shape
        q, k, v = layer.qkv(x).reshape(B, N, 3, 4, 8).permute(2, 0, 3, 1, 4)
        attn = nsa_attention(q, k, v, key_padding_mask=mask, gates=torch.full((3,), 0.5), **SMALL)
        torch.testing.assert_close(layer(x, attn_mask=mask), layer.proj(attn.transpose(1, 2).reshape(B, N, C)))


def test_layer_adds_only_its_gates():
    assert_layer_extras("nsa", {}, {"gate_proj"})
    assert_layer_extras("nsa", {"compression": "mlp"}, {"gate_proj", "compress_k", "compress_v"})


def test_learned_compression_starts_as_block_means_and_learns():
    """compression="mlp": a new layer equals compression="mean" (its MLP's output layer starts at zero),
    padded keys do not reach the compressor, and every compressor parameter gets a gradient once trained."""
    torch.manual_seed(0)
    mean = registry.build_layer("nsa:block_size=4,topk=2,window=3", 32, 4)
    mlp = registry.build_layer("nsa:block_size=4,topk=2,window=3,compression=mlp", 32, 4)
    mlp.load_state_dict(mean.state_dict(), strict=False)
    x, mask = torch.randn(2, 17, 32), padding(2, 17, [17, 11])
    torch.testing.assert_close(mlp(x, attn_mask=mask), mean(x, attn_mask=mask))
    with torch.no_grad():
        for p in mlp.compress_v.fc2.parameters():
            p.normal_()
    y = mlp(x, attn_mask=mask)
    x2 = x.clone()
    x2[1, 11:] = 1e3  # padded tokens changed: nothing real moves
    torch.testing.assert_close(mlp(x2, attn_mask=mask)[:, :11], y[:, :11])
    y.square().sum().backward()
    assert mlp(torch.randn(2, 16, 32)).shape == (2, 16, 32)  # N a multiple of the block: k a strided view, no pad
    for name, p in mlp.named_parameters():
        if name.startswith("compress_v"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"window": -1}, "window"),
        ({"topk": 0}, "topk"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"compression": "conv"}, r"compression must be one of \('mean', 'mlp'\), got 'conv'"),
    ],
)
def test_layer_errors(options, match):
    with pytest.raises(ValueError, match=match):
        registry.build_layer({"name": "nsa", **options}, 32, 4)
