"""Layers with timm's RoPE layouts: ``rope=`` as timm's ``AttentionRope`` / ``EvaAttention`` take it, their
projection and bias layouts, and tokens after the pooled ones (``num_suffix_tokens``) on every layer that pools."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mita import attention as registry
from mita.layers import AgentAttention, MiTAAttention, MiTAVisionAttention
from mita.layers.base import rotate

timm = pytest.importorskip("timm")
from timm.layers import AttentionRope, RmsNorm, apply_rot_embed_cat  # noqa: E402
from timm.models.eva import EvaAttention  # noqa: E402

#: every key of one expert: MiTA's routed branch alone is softmax attention over all N keys
DEGENERATE = {"num_landmarks": 1, "topk": 64, "branches": "routed"}


def _rope(n: int, d: int, *lead: int, dtype=torch.float64, half: bool = False, seed: int = 0) -> torch.Tensor:
    """Sines then cosines (*lead, n, 2 d) of random angles, one per channel pair of the layout."""
    angles = torch.rand(*lead, n, d // 2, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 6
    angles = torch.cat([angles, angles], -1) if half else angles.repeat_interleave(2, dim=-1)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


@pytest.mark.parametrize("half", [False, True], ids=["interleaved", "half"])
@pytest.mark.parametrize(
    ("x_dtype", "rope_dtype"),
    [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=["f64", "f32", "bf16-x"],
)
def test_rotate_is_timms_apply_rot_embed_cat(half, x_dtype, rope_dtype):
    x = torch.randn(2, 3, 7, 8).to(x_dtype)
    rope = _rope(7, 8, dtype=rope_dtype, half=half)
    out = rotate(x, rope, half)
    assert out.dtype == x_dtype
    torch.testing.assert_close(out, apply_rot_embed_cat(x, rope, half=half), rtol=0, atol=0)


def test_rotation_keeps_norms_and_pairs():
    """A rotation: the norm of each rotated pair is kept, and angle zero is the identity."""
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    for half in (False, True):
        out = rotate(x, _rope(5, 8, half=half), half)
        pairs = (lambda t: t.unflatten(-1, (2, 4)).transpose(-1, -2)) if half else (lambda t: t.unflatten(-1, (4, 2)))
        torch.testing.assert_close(pairs(out).norm(dim=-1), pairs(x).norm(dim=-1))
    identity = torch.cat([torch.zeros(5, 8), torch.ones(5, 8)], -1).double()
    torch.testing.assert_close(rotate(x, identity, False), x)


def _timm_rope_layer(cls, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    layer = cls(32, 4, norm_layer=RmsNorm, **kwargs).double().eval()
    with torch.no_grad():  # no zero-initialised biases: a misplaced bias must show
        for name, p in layer.named_parameters():
            if "bias" in name or "norm" in name:
                p.normal_()
    return layer


LAYOUTS = [
    (AttentionRope, {}),
    (AttentionRope, {"qkv_bias": False, "qk_norm": True}),
    (AttentionRope, {"qkv_fused": False, "num_kv_heads": 2, "rotate_half": True}),
    (AttentionRope, {"qkv_fused": False, "num_prefix_tokens": 3, "scale_norm": True, "gated": True}),
    (EvaAttention, {}),
    (EvaAttention, {"qkv_fused": False, "qk_norm": True, "rotate_half": True}),
    (EvaAttention, {"qkv_bias": False, "num_prefix_tokens": 0}),
]
LAYOUT_IDS = ["rope", "rope-qknorm", "rope-gqa-half", "rope-separate", "eva", "eva-separate", "eva-nobias"]


def _layout_of(layer: nn.Module) -> dict:
    """The keyword arguments of a mita layer with a timm RoPE layer's layout."""
    eva = isinstance(layer, EvaAttention)
    qkv_bias = (
        layer.q_bias is not None if eva and layer.qkv is not None else (layer.qkv or layer.q_proj).bias is not None
    )
    return {
        "qkv_bias": qkv_bias,
        "qkv_fused": layer.qkv is not None,
        "num_kv_heads": getattr(layer, "num_kv_heads", 4),
        "key_bias": not eva,
        "rotate_half": layer.rotate_half,
        "num_prefix_tokens": layer.num_prefix_tokens,
        "qk_norm": not isinstance(layer.q_norm, nn.Identity),
        "scale_norm": not isinstance(layer.norm, nn.Identity),
        "gated": layer.gate is not None,
        "norm_layer": RmsNorm,
    }


@pytest.mark.parametrize("rope_lead", [(), (2, 1), (4,)], ids=["shared", "per-batch", "per-head"])
@pytest.mark.parametrize(("cls", "kwargs"), LAYOUTS, ids=LAYOUT_IDS)
def test_layers_with_rope_are_timms_rope_layers(cls, kwargs, rope_lead):
    """State dicts load strictly both ways and the forward with ``rope=`` is timm's: exactly for SDPA,
    and for MiTA where it is softmax attention (one expert holding every key, routed branch alone)."""
    if rope_lead == (4,) and "num_kv_heads" in kwargs:
        pytest.skip("timm rotates k on its 2 kv heads: a rope per query head does not broadcast there")
    timm_layer = _timm_rope_layer(cls, **kwargs)
    p = timm_layer.num_prefix_tokens
    x = torch.randn(2, 3 + 16, 32, dtype=torch.float64)
    rope = _rope(19 - p, 8, *rope_lead)
    expected = timm_layer(x, rope=rope)
    for name, options in (("sdpa", {}), ("mita", DEGENERATE)):
        layer = registry.build_layer({"name": name, **options}, 32, 4, **_layout_of(timm_layer)).double().eval()
        layer.load_state_dict(timm_layer.state_dict())  # strict: the same names and shapes
        assert layer.state_dict().keys() == timm_layer.state_dict().keys()
        torch.testing.assert_close(layer(x, rope=rope), expected, rtol=1e-10, atol=1e-12)
        assert not torch.allclose(layer(x), expected)  # the rope matters


def test_mita_pools_the_rotated_queries():
    """The landmarks come from q after RoPE: the routing record's landmarks are the pooled rotated queries."""
    layer = MiTAAttention(32, 4, num_landmarks=4, topk=5, grid="auto", num_prefix_tokens=1, num_suffix_tokens=2)
    layer.record_routing = True
    x, rope = torch.randn(1, 1 + 16 + 2, 32), _rope(18, 8, dtype=torch.float32)
    layer(x, rope=rope)
    q, k, _ = layer.project(x)
    q, _ = layer.apply_rope(q, k, rope)
    patches = q[0, :, 1:17].transpose(-1, -2).unflatten(-1, (4, 4))  # (H, D, 4, 4): the suffix is not pooled
    pooled = nn.functional.adaptive_avg_pool2d(patches, 2).flatten(-2).transpose(-1, -2)
    torch.testing.assert_close(layer.routing.landmarks[0], pooled)


@pytest.mark.parametrize(
    ("rope", "error", "match"),
    [
        (torch.zeros(17, 16), ValueError, r"rope must be a tensor \(\.\.\., N - num_prefix_tokens, 2 \* head_dim\)"),
        (torch.zeros(19, 8), ValueError, r"= \(\.\.\., 18, 16\)"),
        (torch.zeros(18, 16, dtype=torch.long), TypeError, "rope must be a floating-point tensor"),
        ([[0.0] * 16] * 18, ValueError, "got list"),
    ],
    ids=["short", "wrong-width", "integer", "list"],
)
def test_bad_rope_is_refused(rope, error, match):
    layer = registry.build_layer("sdpa", 32, 4, num_prefix_tokens=1)
    with pytest.raises(error, match=match):
        layer(torch.randn(1, 19, 32), rope=rope)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_kv_heads": 2}, ValueError, "differ from it only with qkv_fused=False"),
        ({"num_kv_heads": 3, "qkv_fused": False}, ValueError, "num_kv_heads=3 must divide num_heads=4"),
        ({"qkv_fused": 1}, TypeError, "qkv_fused must be True or False"),
        ({"key_bias": None}, TypeError, "key_bias must be True or False"),
        ({"num_suffix_tokens": -1}, ValueError, "num_suffix_tokens"),
        ({"num_prefix_tokens": 1.5}, ValueError, "num_prefix_tokens"),
    ],
    ids=["gqa-fused", "gqa-divisor", "fused-type", "key-bias-type", "suffix", "prefix"],
)
@pytest.mark.parametrize("name", ["sdpa", "mita", "agent"])
def test_layout_arguments_are_checked_at_construction(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        registry.build_layer(name, 32, 4, **kwargs)


def test_eva_bias_layout_names():
    """EVA's layout: a bias-free ``qkv`` with ``q_bias`` and ``v_bias``; separate: a bias-free ``k_proj``."""
    fused = registry.build_layer("sdpa", 32, 4, qkv_bias=True, key_bias=False)
    assert {"qkv.weight", "q_bias", "v_bias"} <= fused.state_dict().keys() and "qkv.bias" not in fused.state_dict()
    separate = registry.build_layer("sdpa", 32, 4, qkv_bias=True, key_bias=False, qkv_fused=False)
    assert separate.k_proj.bias is None and separate.q_proj.bias is not None and separate.v_proj.bias is not None


# -- tokens after the pooled ones ------------------------------------------------------------------------

SUFFIX_LAYERS = [
    ("mita", {"num_landmarks": 4, "topk": 5, "num_routed": 2}),
    ("mita", {"num_landmarks": 4, "topk": 5, "dwc": True}),
    ("agent", {"num_agents": 4, "dwc": True}),
    ("mhla", {"num_blocks": 4}),
    ("flatten", {"dwc": True}),
    ("pola", {"dwc": True}),
    ("inline", {}),
]


def _layer(name: str, options: dict, prefix: int, suffix: int) -> nn.Module:
    torch.manual_seed(0)
    kwargs = {"grid": (3, 4), "num_prefix_tokens": prefix, "num_suffix_tokens": suffix, **options}
    if name == "mita":
        return MiTAVisionAttention(32, 4, **kwargs).double()
    return registry.build_layer(name, 32, 4, **kwargs).double()


@pytest.mark.parametrize(
    ("name", "options"),
    SUFFIX_LAYERS,
    ids=["mita", "mita-dwc", "agent-dwc", "mhla", "flatten-dwc", "pola-dwc", "inline"],
)
def test_suffix_tokens_are_prefix_tokens_moved(name, options):
    """Attention is a function of the token set: the last s tokens, declared suffix, give the outputs
    (and gradients) they give when moved to the front and declared prefix; the convolutions and
    pools see the same grid either way."""
    x = torch.randn(2, 1 + 12 + 3, 32, dtype=torch.float64, requires_grad=True)
    with_suffix = _layer(name, options, 1, 3)
    as_prefix = _layer(name, options, 4, 0)
    as_prefix.load_state_dict(with_suffix.state_dict())
    moved = torch.cat([x[:, -3:], x[:, :-3]], 1)
    out, out_moved = with_suffix(x), as_prefix(moved)
    torch.testing.assert_close(out, torch.cat([out_moved[:, 3:], out_moved[:, :3]], 1))
    g, g_moved = (torch.autograd.grad(y.square().sum(), x)[0] for y in (out, out_moved))
    torch.testing.assert_close(g, g_moved)


def test_suffix_with_auto_grid_and_official_compat():
    """ "auto" takes a square of the tokens between prefix and suffix; compat="official" with suffix
    tokens is the authors' ViT-5: those tokens pooled, landmark logits at 1/D."""
    layer = MiTAAttention(32, 4, num_landmarks=4, topk=6, grid="auto", num_prefix_tokens=1, num_suffix_tokens=4)
    assert layer.resolve_grid(1 + 36 + 4) == (6, 6)
    with pytest.raises(ValueError, match="N - num_prefix_tokens - num_suffix_tokens = 40 - 1 - 4"):
        layer.resolve_grid(40)
    official = MiTAAttention(
        32, 4, num_landmarks=4, topk=6, num_prefix_tokens=1, num_suffix_tokens=4, compat="official"
    )
    official.load_state_dict(layer.state_dict())
    x = torch.randn(2, 41, 32)
    q, k, v = (t for t in layer.project(x))
    scaled = official.attend(q, k, v, None, False)
    plain = layer.attend(q, k, v, None, False)
    assert not torch.allclose(scaled, plain)
    from mita import mita_attention

    expected = mita_attention(
        q, k, v, num_landmarks=4, topk=6, grid=(6, 6), num_prefix_tokens=1, num_suffix_tokens=4, landmark_scale=1 / 8
    )
    torch.testing.assert_close(scaled, expected)


def test_agent_bias_refuses_suffix_tokens():
    with pytest.raises(ValueError, match="agent_bias has no terms for suffix tokens"):
        AgentAttention(32, 4, num_agents=4, grid=(3, 4), agent_bias=True, num_suffix_tokens=2)


def test_a_layer_with_rope_and_suffix_compiles_whole():
    layer = MiTAAttention(32, 4, num_landmarks=4, topk=5, grid="auto", num_prefix_tokens=1, num_suffix_tokens=2)
    x, rope = torch.randn(2, 19, 32), _rope(18, 8, dtype=torch.float32)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, rope=rope), layer(x, rope=rope))
