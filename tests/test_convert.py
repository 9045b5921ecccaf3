"""mita.convert: the patch grid of each forward on timm models of varying image size, and its option errors."""

from __future__ import annotations

import copy
import re

import pytest
import torch

timm = pytest.importorskip("timm")

from mita import attention as registry  # noqa: E402
from mita.integrations.timm import MiTAVisionAttention, convert, revert  # noqa: E402
from mita.layers.base import AttentionLayer  # noqa: E402


def dynamic_vit(img_size=(96, 96), **kwargs) -> torch.nn.Module:
    """A 2-block timm ViT with ``dynamic_img_size``: patch 16, built for ``img_size``, run on any size."""
    args = dict(patch_size=16, embed_dim=32, depth=2, num_heads=2, num_classes=5, dynamic_img_size=True)
    torch.manual_seed(0)
    return timm.models.VisionTransformer(img_size=img_size, **{**args, **kwargs}).eval()


def with_fixed_grid(model: torch.nn.Module, grid: tuple[int, int]) -> torch.nn.Module:
    """A copy of a converted model whose layers pool on ``grid``, whatever the input."""
    fixed = copy.deepcopy(model)
    for layer in fixed.modules():
        if isinstance(layer, AttentionLayer):
            layer.patch_grid, layer.grid = None, grid
    return fixed


@pytest.mark.parametrize("built_for", [(192, 192), (256, 144)], ids=["square-model", "non-square-model"])
@pytest.mark.parametrize(
    ("image", "grid"),
    [((256, 144), (16, 9)), ((144, 256), (9, 16)), ((192, 192), (12, 12))],
    ids=["16x9", "9x16", "12x12"],
)
@pytest.mark.parametrize(
    ("attention", "options"),
    [
        ("mita", {"num_landmarks": (3, 3), "topk": 12}),
        ("mita", {"num_landmarks": 4, "topk": 9, "dwc": True}),
        ("agent", {"num_agents": (2, 3)}),
    ],
    ids=["mita", "mita-dwc", "agent"],
)
def test_dynamic_img_size_pools_each_image_on_its_own_grid(built_for, image, grid, attention, options):
    """A 256x144 image is 16x9 patches (144 = 12^2, but not 12x12), its transpose 9x16: each is pooled
    on its own grid, as by the same model given that grid explicitly."""
    model = convert(dynamic_vit(built_for), attention, **options)
    x = torch.randn(2, 3, *image)
    with torch.no_grad():
        torch.testing.assert_close(model(x), with_fixed_grid(model, grid)(x), rtol=0, atol=0)
        other = (1, 3, *image[::-1])  # another grid in between does not stay behind
        model(torch.randn(other))
        torch.testing.assert_close(model(x), with_fixed_grid(model, grid)(x), rtol=0, atol=0)


def test_the_grid_follows_copies_and_reverts():
    model = convert(dynamic_vit(), "mita", num_landmarks=4, topk=8)
    x = torch.randn(1, 3, 256, 144)
    with torch.no_grad():
        expected = with_fixed_grid(model, (16, 9))(x)
        torch.testing.assert_close(copy.deepcopy(model)(x), expected, rtol=0, atol=0)
        convert(model, "mita:num_landmarks=4,topk=8")  # converting again keeps one hook
        assert len(model.patch_embed._forward_pre_hooks) == 1
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    revert(model)
    assert not model.patch_embed._forward_pre_hooks


def test_static_models_get_no_hook():
    model = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2).eval()
    convert(model, "mita", num_landmarks=4, topk=8)
    assert not model.patch_embed._forward_pre_hooks
    assert model.blocks[0].attn.patch_grid is None and model.blocks[0].attn.grid == "auto"
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1000)


def test_a_layer_called_on_its_own_uses_its_grid():
    """Tokens that are not the running image's grid (a block called by hand) fall back to the layer's grid."""
    model = convert(dynamic_vit(), "mita", num_landmarks=4, topk=8)
    attn = model.blocks[0].attn
    with torch.no_grad():
        model(torch.randn(1, 3, 256, 144))
        tokens = torch.randn(1, 1 + 36, 32)  # a 6x6 grid: "auto"
        torch.testing.assert_close(attn(tokens), with_fixed_grid(model, (6, 6)).blocks[0].attn(tokens))


def listed_options(message: str) -> list[str]:
    return re.search(r"its options: (\[.*?\])", message).group(1).strip("[]").replace("'", "").split(", ")


MITA_OPTIONS = [
    "branches",
    "compat",
    "dwc",
    "grid",
    "impl",
    "landmark_pooling",
    "merge_duplicates",
    "num_landmarks",
    "num_prefix_tokens",
    "num_routed",
    "num_suffix_tokens",
    "out_gate",
    "topk",
]


@pytest.mark.parametrize("option", ["dropout_p", "landmarks", "key_padding_mask", "return_routing", "bogus"])
def test_convert_lists_exactly_the_options_it_takes(option):
    """Op arguments the layer passes itself are no options: refused up front, never listed."""
    with pytest.raises(ValueError, match=rf"attention 'mita' takes no options \['{option}'\]") as err:
        convert(dynamic_vit(), "mita", **{option: None})
    assert listed_options(str(err.value)) == MITA_OPTIONS


@pytest.mark.parametrize("name", [n for n in registry.names() if n != "mita"])
def test_convert_error_options_are_the_layers(name):
    """The per-call arguments of the op (masks, dropout) are never listed; the layer's options are."""
    with pytest.raises(ValueError, match="takes no options") as err:
        convert(dynamic_vit(), name, bogus=1)
    listed = listed_options(str(err.value))
    assert not {"dropout_p", "key_padding_mask", "query_padding_mask", "is_causal", "landmarks"} & set(listed)
    assert listed == registry.layer_options(registry.get(name))


def test_every_listed_mita_option_is_taken():
    values = dict(
        branches="shared",
        compat=None,
        dwc=True,
        grid=(6, 6),
        impl="grouped",
        landmark_pooling="distinct",
        merge_duplicates=True,
        num_landmarks=4,
        num_prefix_tokens=1,
        num_routed=2,
        num_suffix_tokens=0,
        out_gate=True,
        topk=9,
    )
    assert sorted(values) == MITA_OPTIONS
    model = convert(dynamic_vit(), "mita", **values)
    assert isinstance(model.blocks[0].attn, MiTAVisionAttention) and model.blocks[0].attn.num_routed == 2


def test_an_agent_bias_refuses_another_grid():
    """The bias is learned per row and column of the grid it was built for: a transposed image is refused."""
    model = convert(dynamic_vit((256, 144)), "agent", num_agents=4, agent_bias=True)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 256, 144)).shape == (1, 5)
        with pytest.raises(ValueError, match=r"built for the grid \(16, 9\), this input's grid is \(9, 16\)"):
            model(torch.randn(1, 3, 144, 256))


# -- timm's RoPE families: EvaAttention and AttentionRope, which receive ``rope=`` from the model ------------

#: one model per family that uses them, built tiny (each key: the family; value: timm name, extra arguments)
ROPE_FAMILIES = {
    "eva": ("eva_giant_patch14_224", {}),  # EvaAttention, no rope
    "eva02": ("eva02_tiny_patch14_224", {}),  # EvaAttention (q_bias, v_bias), RoPE, SwiGLU
    "rope-axial": ("vit_base_patch16_rope_224", {}),  # AttentionRope, axial RoPE
    "rope-mixed": ("vit_base_patch16_rope_mixed_ape_224", {}),  # AttentionRope, learned per-layer RoPE
    "rope-reg": ("vit_betwixt_patch16_rope_reg4_gap_256", {}),  # four registers in the prefix, avg pool
    "pe": ("vit_pe_core_tiny_patch16_384", {}),  # Perception Encoder: RoPE, attention-pool head
    "dinov3": ("vit_small_patch16_dinov3_qkvb", {}),  # DINOv3's RoPE, CLS + 4 registers
}


def rope_vit(family: str, img_size=(32, 48), **kwargs) -> torch.nn.Module:
    """A 2-block float64 model of ``family`` with its layer scales at 1 (the attention's output counts)."""
    name, extra = ROPE_FAMILIES[family]
    args = dict(pretrained=False, img_size=img_size, patch_size=8, depth=2, embed_dim=64, num_heads=4, num_classes=5)
    torch.manual_seed(0)
    model = timm.create_model(name, **{**args, **extra, **kwargs}).double().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "gamma" in pname or pname.endswith("bias"):  # no zero-initialised parameter hides a mistake
                p.normal_(1.0 if "gamma" in pname else 0.0, 0.5)
    return model


def degenerate(model: torch.nn.Module, image: tuple[int, int]) -> dict:
    """MiTA that is softmax attention: the routed branch alone, one expert holding every key."""
    n = (
        model.num_prefix_tokens
        + model.patch_embed.dynamic_feat_size(image)[0] * model.patch_embed.dynamic_feat_size(image)[1]
    )
    return {"num_landmarks": 1, "topk": n, "branches": "routed"}


@pytest.mark.parametrize("family", list(ROPE_FAMILIES))
def test_rope_families_convert_to_their_own_forward(family):
    """Converted to MiTA where it degenerates to softmax attention, the model's forward is timm's; the
    state dict is unchanged, a different m changes the output, and "timm" gives back the same classes."""
    model = rope_vit(family)
    x = torch.randn(2, 3, 32, 48, dtype=torch.float64)
    classes = [type(m) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected, features = model(x), model.forward_features(x)
        convert(model, "mita", **degenerate(model, (32, 48)))
        attn = model.blocks[0].attn
        assert isinstance(attn, MiTAVisionAttention) and attn.grid == (4, 6)
        torch.testing.assert_close(model.forward_features(x), features, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(model(x), expected, rtol=1e-9, atol=1e-10)
        assert model.state_dict().keys() == state.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        for layer in model.modules():
            if isinstance(layer, MiTAVisionAttention):
                layer.num_landmarks, layer.topk, layer.branches = 4, 6, "both"
        assert not torch.allclose(model.forward_features(x), features, rtol=1e-3, atol=1e-3)
        revert(model)
        assert [type(m) for m in model.modules()] == classes
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["eva02", "dinov3"])
def test_rope_families_with_dynamic_img_size_pool_each_image_on_its_grid(family):
    """Eva with ``dynamic_img_size`` gets its rope and grid from each image; MiTA follows the grid."""
    model = convert(rope_vit(family, img_size=(48, 48), dynamic_img_size=True), "mita", num_landmarks=4, topk=6)
    for image, grid in (((32, 64), (4, 8)), ((64, 32), (8, 4))):
        x = torch.randn(1, 3, *image, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(model(x), with_fixed_grid(model, grid)(x), rtol=0, atol=0)


def test_gqa_and_separate_projections_convert_both_ways():
    """AttentionRope with separate projections and grouped kv heads (Sapiens2's layout): kept, and back."""
    layer = timm.layers.AttentionRope(32, 4, qkv_fused=False, num_kv_heads=2, num_prefix_tokens=1).double().eval()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    rope = torch.randn(12, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = layer(x, rope=rope)
        new = convert(layer, "mita", num_landmarks=1, topk=13, branches="routed")
        assert new.k_proj.out_features == 16 and new.num_kv_heads == 2
        torch.testing.assert_close(new(x, rope=rope), expected, rtol=1e-10, atol=1e-12)
        back = convert(new, "timm")
        assert type(back) is timm.layers.AttentionRope and back.num_kv_heads == 2
        torch.testing.assert_close(back(x, rope=rope), expected, rtol=0, atol=0)


class _SubclassedAttention(timm.layers.Attention):
    """A subclass of timm's Attention: its forward may differ, so it is not converted."""


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: timm.create_model("beit_base_patch16_224", img_size=32, depth=1, embed_dim=32, num_heads=2), "beit"),
        (
            lambda: timm.create_model("vit_relpos_base_patch16_224", img_size=32, depth=1, embed_dim=32, num_heads=2),
            "RelPos",
        ),
        (lambda: timm.create_model("swin_tiny_patch4_window7_224", depths=(1, 1, 1, 1)), "WindowAttention"),
        (lambda: torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2)), "MultiheadAttention"),
        (lambda: torch.nn.Sequential(_SubclassedAttention(8, 2)), "_SubclassedAttention"),
    ],
    ids=["beit", "relpos", "swin", "torch-mha", "subclass"],
)
def test_other_attention_classes_are_refused_by_name(build, name):
    model = build()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=rf"convert cannot take \S*{name}\S* \(at "):
        convert(model, "mita")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was touched


@pytest.mark.parametrize("separate", [False, True])
def test_eva_qkv_bias_separate_survives_the_round_trip(separate):
    """EvaAttention's ``qkv_bias_separate`` (how its q/v biases are added) comes back on revert."""
    layer = timm.models.eva.EvaAttention(32, 4, qkv_bias=True, qkv_bias_separate=separate, scale_norm=False)
    model = torch.nn.Sequential(layer)
    convert(model, "mita", num_landmarks=1, topk=4, grid=None)
    assert model[0].timm_qkv_bias_separate is separate
    revert(model)
    assert isinstance(model[0], timm.models.eva.EvaAttention) and model[0].qkv_bias_separate is separate
