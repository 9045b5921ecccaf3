"""The zoo's ops (top-k, MoBA, linear, Agent, Nystrom, SDPA): fast paths against their references, masks, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _zoo import CAUSAL, F64, IMPLEMENTED, NO_DROPOUT, _small, dense, padding, qkv
from mita import attention as registry
from mita.ops.agent import agent_attention, agent_attention_reference
from mita.ops.common import topk_indices
from mita.ops.linear import linear_attention, linear_attention_reference
from mita.ops.moba import moba_attention, moba_attention_reference
from mita.ops.nystrom import iterative_pinv, nystrom_attention, nystrom_attention_reference
from mita.ops.sdpa import sdpa_attention
from mita.ops.topk import topk_attention, topk_attention_reference

PAIRS = {
    "topk": (topk_attention, topk_attention_reference, {"topk": 5, "chunk_size": 7}),
    "moba": (moba_attention, moba_attention_reference, {"block_size": 6, "topk": 2, "chunk_size": 5}),
    "linear": (linear_attention, linear_attention_reference, {"chunk_size": 6}),
    "agent": (agent_attention, agent_attention_reference, {"num_agents": 5}),
    "agent_2d": (agent_attention, agent_attention_reference, {"num_agents": 4, "grid": (6, 6), "num_prefix_tokens": 1}),
    "nystrom": (nystrom_attention, nystrom_attention_reference, {"num_landmarks": 5}),
}


CASES = [
    pytest.param(name, mask, causal, id=f"{name}-{'mask' if mask else 'nomask'}{'-causal' if causal else ''}")
    for name in PAIRS
    for mask in (False, True)
    for causal in ((False, True) if name in CAUSAL else (False,))
]


OP_ERRORS = [
    (topk_attention, {"topk": 0}, ValueError, "topk"),
    (topk_attention, {"topk": 3, "chunk_size": 0}, ValueError, "chunk_size"),
    (topk_attention, {"topk": 3, "causal": True, "cross": True}, ValueError, "Nq == Nk"),
    (topk_attention, {"topk": 3, "dropout_p": 1.0}, ValueError, "dropout_p"),
    (moba_attention, {"block_size": 0, "topk": 1}, ValueError, "block_size"),
    (moba_attention, {"block_size": 4, "topk": True}, ValueError, "topk"),
    (moba_attention, {"block_size": 4, "topk": 1, "is_causal": True, "cross": True}, ValueError, "Nq == Nk"),
    (linear_attention, {"dropout_p": 0.1}, ValueError, "dropout_p"),
    (linear_attention, {"causal": True, "chunk_size": -1}, ValueError, "chunk_size"),
    (linear_attention, {"causal": True, "cross": True}, ValueError, "Nq == Nk"),
    (nystrom_attention, {"num_landmarks": 0}, ValueError, "num_landmarks"),
    (nystrom_attention, {"num_landmarks": 4, "pinv_iterations": 0}, ValueError, "pinv_iterations"),
    (nystrom_attention, {"num_landmarks": 4, "dropout_p": 0.2}, ValueError, "dropout_p"),
    (agent_attention, {"num_agents": 0}, ValueError, "num_agents must be an int >= 1"),
    (agent_attention, {"num_agents": 4, "agents": torch.zeros(2, 4, 3)}, ValueError, "agents must be a tensor"),
    (agent_attention, {"num_agents": 4, "grid": (3, 3)}, ValueError, "grid"),
    (agent_attention, {"num_agents": 4, "aggregate_bias": torch.zeros(3, 4, 12)}, ValueError, "aggregate_bias"),
    (agent_attention, {"num_agents": 4, "broadcast_bias": torch.zeros(4, 12, 5)}, ValueError, "broadcast_bias"),
    (agent_attention, {"num_agents": 4, "broadcast_bias": "zero"}, TypeError, "broadcast_bias"),
    (agent_attention, {"num_agents": 4, "key_padding_mask": torch.ones(2, 12)}, TypeError, "key_padding_mask"),
    (
        topk_attention,
        {"topk": 2, "key_padding_mask": torch.ones(2, 11, dtype=torch.bool)},
        ValueError,
        "key_padding_mask",
    ),
]


@pytest.mark.parametrize(("name", "masked", "causal"), CASES)
def test_efficient_matches_reference(name, masked, causal, device):
    fast, ref, options = PAIRS[name]
    q, k, v = (t.requires_grad_() for t in qkv(device=device))
    extra = {"causal": True} if causal else {}
    mask = padding(2, 37, [37, 29], device) if masked else None
    out = fast(q, k, v, key_padding_mask=mask, **options, **extra)
    expected = ref(q, k, v, key_padding_mask=mask, **{o: x for o, x in options.items() if o != "chunk_size"}, **extra)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(["topk", "moba", "linear", "nystrom", "agent"]),
    groups=st.sampled_from([(1, 1), (3, 1), (4, 2)]),
    n=st.integers(1, 40),
    option=st.integers(1, 12),
    cut=st.integers(0, 39),
    causal=st.booleans(),
)
def test_efficient_matches_reference_on_random_shapes(name, groups, n, option, cut, causal):
    fast, ref, _ = PAIRS[name]
    options = {
        "topk": {"topk": option},
        "moba": {"block_size": option, "topk": 1 + option % 3},
        "linear": {},
        "nystrom": {"num_landmarks": option},
        "agent": {"num_agents": option},
    }[name]
    if causal and name in CAUSAL:
        options["causal"] = True
    q, k, v = qkv(H=groups[0], Hkv=groups[1], Nq=n, Nk=n, D=4)
    mask = padding(2, n, [n, max(1, n - cut)])
    torch.testing.assert_close(
        fast(q, k, v, key_padding_mask=mask, **options),
        ref(q, k, v, key_padding_mask=mask, **options),
        rtol=1e-9,
        atol=1e-11,
    )


@pytest.mark.parametrize("name", [n for n in PAIRS if n not in ("agent_2d",)])
def test_cross_attention_matches_reference(name):
    fast, ref, options = PAIRS[name]
    q, k, v = qkv(Nq=23, Nk=41)
    mask = padding(2, 41, [41, 30])
    out = fast(q, k, v, key_padding_mask=mask, **options)
    expected = ref(q, k, v, key_padding_mask=mask, **{o: x for o, x in options.items() if o != "chunk_size"})
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_topk_with_k_equal_n_is_softmax_attention(causal):
    q, k, v = qkv()
    mask = padding(2, 37, [37, 20])
    out = topk_attention(q, k, v, topk=37, key_padding_mask=mask, causal=causal, chunk_size=8)
    torch.testing.assert_close(out, dense(q, k, v, mask, causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_size", [1, 6, 37, 50], ids=lambda b: f"block{b}")
def test_moba_with_every_block_selected_is_softmax_attention(block_size, causal):
    q, k, v = qkv()
    mask = padding(2, 37, [37, 25])
    out = moba_attention(q, k, v, block_size=block_size, topk=37, key_padding_mask=mask, causal=causal)
    torch.testing.assert_close(out, dense(q, k, v, mask, causal))


def test_moba_causal_always_keeps_the_own_block():
    """With one block per query the causal output is attention over the own block's past keys."""
    q, k, v = qkv(H=2, Hkv=2, Nq=12, Nk=12)
    out = moba_attention(q, k, v, block_size=4, topk=1, causal=True)
    i = torch.arange(12)
    own = (i[:, None] // 4 == i // 4) & (i <= i[:, None])
    logits = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~own, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v)


def test_mita_shared_is_attention_over_the_landmarks_compressed_values():
    q, k, v = qkv(Hkv=4, Nq=30, Nk=30)
    m, s = 6, 8**-0.5
    out = registry.build_op("mita_shared:num_landmarks=6")(q, k, v)
    landmarks = F.adaptive_avg_pool1d(q.flatten(0, 1).transpose(1, 2), m).transpose(1, 2).unflatten(0, (2, 4))
    compressed = torch.softmax(s * landmarks @ k.transpose(-1, -2), -1) @ v  # (B, H, m, D)
    expected = torch.softmax(s * q @ landmarks.transpose(-1, -2), -1) @ compressed
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, agent_attention(q, k, v, num_agents=m))  # the same closed form


def test_agent_attention_with_given_agents():
    q, k, v = qkv()
    agents = torch.randn(2, 4, 3, 8, dtype=F64)
    out = agent_attention(q, k, v, num_agents=1, agents=agents)
    torch.testing.assert_close(out, agent_attention_reference(q, k, v, num_agents=1, agents=agents))
    expected = torch.softmax(q @ agents.transpose(-1, -2) / 8**0.5, -1) @ (
        torch.softmax(agents @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5, -1) @ v.repeat_interleave(2, 1)
    )
    torch.testing.assert_close(out, expected)


def test_mita_routed_with_k_equal_n_is_softmax_attention():
    q, k, v = qkv(Nq=30, Nk=30)
    out = registry.build_op("mita_routed:num_landmarks=4,topk=30")(q, k, v)
    torch.testing.assert_close(out, sdpa_attention(q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_linear_attention_is_the_normalised_kernel_matrix(causal):
    q, k, v = qkv(H=2, Hkv=1, Nq=9, Nk=9, D=3)
    phi_q, phi_k = torch.where(q > 0, q + 1, q.exp()), torch.where(k > 0, k + 1, k.exp())  # elu + 1
    out = linear_attention(q, k, v, causal=causal, chunk_size=4)
    for b, h, i in [(0, 0, 0), (1, 1, 4), (0, 1, 8)]:
        w = torch.stack([phi_q[b, h, i] @ phi_k[b, 0, j] for j in range(9)])
        if causal:
            w[i + 1 :] = 0
        torch.testing.assert_close(out[b, h, i], (w / w.sum()) @ v[b, 0])


def test_nystrom_with_every_token_a_landmark_and_exact_pinv_is_softmax_attention():
    q, k, v = qkv(Nq=20, Nk=20)
    out = nystrom_attention(q, k, v, num_landmarks=20, pinv_iterations=None)
    torch.testing.assert_close(out, sdpa_attention(q, k, v), rtol=1e-8, atol=1e-9)


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    a = torch.softmax(torch.randn(3, 6, 6, dtype=F64), -1)
    torch.testing.assert_close(iterative_pinv(a, 30), torch.linalg.pinv(a), rtol=1e-6, atol=1e-8)
    assert (iterative_pinv(a, 6) @ a - torch.eye(6, dtype=F64)).abs().max() < 0.5  # 6 steps: approximate


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_masked_sequence_equals_the_truncated_sequence(name):
    """Padded tokens take no part: a padded sequence gives the truncated sequence's output, zeros after."""
    op = registry.build_op({"name": name, **_small(name)})
    q, k, v = qkv(B=2, Hkv=4, Nq=33, Nk=33)
    mask = padding(2, 33, [33, 26])
    out = op(q, k, v, key_padding_mask=mask)
    alone = op(q[1:, :, :26], k[1:, :, :26], v[1:, :, :26])
    torch.testing.assert_close(out[1, :, :26], alone[0])
    assert (out[1, :, 26:] == 0).all()
    torch.testing.assert_close(out[:1], op(q[:1], k[:1], v[:1]))


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_output_ignores_the_future(name):
    op = registry.build_op({"name": name, **_small(name)})
    q, k, v = qkv(Nq=24, Nk=24)
    causal = {"is_causal": True}
    out = op(q, k, v, **causal)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, 15:] = torch.randn_like(t[:, :, 15:])
    torch.testing.assert_close(op(q2, k2, v2, **causal)[:, :, :15], out[:, :, :15])


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_float32_matches_float64(name):
    op = registry.build_op({"name": name, **_small(name)})
    q, k, v = qkv(Nq=21, Nk=21)
    out = op(q.float(), k.float(), v.float())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), op(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_bfloat16_runs_and_keeps_the_dtype(name):
    op = registry.build_op({"name": name, **_small(name)})
    q, k, v = (t.bfloat16() for t in qkv(Nq=21, Nk=21))
    out = op(q, k, v, key_padding_mask=padding(2, 21, [21, 17]))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_dropout(name):
    op = registry.build_op({"name": name, **_small(name)})
    q, k, v = qkv(Nq=16, Nk=16)
    if name in NO_DROPOUT:
        with pytest.raises(ValueError, match="dropout_p"):
            op(q, k, v, dropout_p=0.1)
        return
    assert not torch.allclose(op(q, k, v, dropout_p=0.5), op(q, k, v))


@pytest.mark.parametrize(
    ("op", "options", "error", "match"),
    OP_ERRORS,
    ids=[f"{op.__name__}-{match}-{i}" for i, (op, _, _, match) in enumerate(OP_ERRORS)],
)
def test_op_errors_name_the_argument(op, options, error, match):
    options = dict(options)
    q, k, v = qkv(Nq=12, Nk=16 if options.pop("cross", False) else 12)
    with pytest.raises(error, match=match):
        op(q, k, v, **options)


def test_ops_reject_bad_tensors():
    q, k, v = qkv(Nq=12, Nk=12)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        topk_attention(q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), topk=2)
    with pytest.raises(TypeError, match="share one dtype"):
        linear_attention(q, k.float(), v)
    with pytest.raises(ValueError, match=r"\(B, H, N, D\)"):
        moba_attention(q[0], k, v, block_size=4, topk=1)


def test_sdpa_causal_with_padding_mask() -> None:
    """A padding mask and is_causal together: the real prefix attends causally, padded rows are zero."""
    q = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    out = sdpa_attention(q, q, q, key_padding_mask=mask, is_causal=True)
    expected = F.scaled_dot_product_attention(q[1:, :, :4], q[1:, :, :4], q[1:, :, :4], is_causal=True)
    torch.testing.assert_close(out[1:, :, :4], expected)
    assert out[1, :, 4:].abs().max() == 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(0, 2**16),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_topk_indices_largest_first_ties_to_the_lower_index(n: int, seed: int, dtype: torch.dtype) -> None:
    """Against sorting by (value descending, index ascending): many ties, signed zeros, -inf (padding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (3, n), generator=gen) + 0.25 * torch.randint(0, 2, (3, n), generator=gen)
    x[x == 0] = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -0.0, 0.0)[x == 0]
    x[torch.rand(x.shape, generator=gen) < 0.2] = float("-inf")
    x = x.to(dtype)
    k = int(torch.randint(1, n + 1, (), generator=gen))
    want = [sorted(range(n), key=lambda j, row=row: (-float(row[j]), j))[:k] for row in x]
    assert topk_indices(x, k).tolist() == want
