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
    "num_landmarks",
    "num_prefix_tokens",
    "num_routed",
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
        num_landmarks=4,
        num_prefix_tokens=1,
        num_routed=2,
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
