"""Models (timm): the mita_deit_* names, layers' timm state dicts, convert() round trips, authors' checkpoints."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")

from timm.models.vision_transformer import Attention as TimmAttention  # noqa: E402

import mita  # noqa: E402
from _zoo import IMPLEMENTED, LAYER_EXTRAS, padding  # noqa: E402
from mita import attention as registry  # noqa: E402
from mita.integrations.timm import MODEL_NAMES, MiTAVisionAttention, convert, revert  # noqa: E402
from mita.ops.mita import mita_attention  # noqa: E402


def tiny_vit(**kwargs) -> torch.nn.Module:
    """A 2-block timm ViT on 32 px images (patch 4: an 8x8 grid plus CLS)."""
    args = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5, qkv_bias=True)
    return timm.models.VisionTransformer(**{**args, **kwargs}).eval()


def test_import_mita_registers_every_name():
    assert set(MODEL_NAMES) <= set(timm.list_models("mita_deit_*"))
    assert len(MODEL_NAMES) == 9


@pytest.mark.parametrize("name", ["mita_deit_small_patch16_224", "mita_deit_base_patch16_224_dwc_gate"])
def test_create_model_defaults(name):
    model = timm.create_model(name, depth=1)
    attn = model.blocks[0].attn
    assert isinstance(attn, MiTAVisionAttention)
    assert (attn.num_landmarks, attn.topk, attn.num_prefix_tokens, attn.grid) == (25, 25, 1, "auto")
    assert (attn.dwc is not None, attn.out_gate is not None) == ("dwc" in name, "gate" in name)
    assert model.pretrained_cfg["input_size"] == (3, 224, 224)


@pytest.mark.parametrize("suffix", ["", "_dwc", "_dwc_gate"], ids=["plain", "dwc", "dwc_gate"])
def test_train_one_step(suffix):
    model = timm.create_model(f"mita_deit_tiny_patch16_224{suffix}", depth=2, num_classes=3, num_landmarks=9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 3, 224, 224), torch.tensor([0, 2])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "blocks.0.attn.qkv.weight" in changed
    if suffix:
        assert "blocks.0.attn.dwc.weight" in changed
    if "gate" in suffix:
        assert "blocks.0.attn.out_gate.weight" in changed


def test_options_reach_the_layers():
    model = timm.create_model("mita_deit_tiny_patch16_224", depth=1, num_landmarks=49, topk=49, compat="official")
    attn = model.blocks[0].attn
    assert (attn.num_landmarks, attn.topk, attn.compat) == (49, 49, "official")


def test_pretrained_without_file_is_refused():
    with pytest.raises(ValueError, match="pretrained_cfg_overlay"):
        timm.create_model("mita_deit_tiny_patch16_224", pretrained=True, depth=1)


def test_pretrained_from_local_file(tmp_path):
    src = timm.create_model("mita_deit_tiny_patch16_224_dwc", depth=1)
    path = tmp_path / "ckpt.pth"
    torch.save({"model": src.state_dict(), "epoch": 299}, path)  # DeiT's checkpoint layout
    model = timm.create_model(
        "mita_deit_tiny_patch16_224_dwc", pretrained=True, depth=1, pretrained_cfg_overlay={"file": str(path)}
    )
    for key, value in src.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("target", ["mita", "sdpa", "mita:num_landmarks=16,topk=8"], ids=["mita", "sdpa", "config"])
def test_convert_round_trips_state_dict_exactly(target):
    model = tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    convert(model, target)
    assert not any(isinstance(m, timm.layers.Attention) for m in model.modules())
    assert [id(p) for p in model.parameters()] == params  # the same tensors, moved
    revert(model)
    assert all(type(b.attn) is timm.layers.Attention for b in model.blocks)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_convert_sdpa_keeps_outputs():
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        out = convert(model, "sdpa")(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_convert_mita_with_all_tokens_is_close_to_full_attention():
    """m = 64 landmarks and top-k = all 65 keys: every query sees every key once, plus m shared slots."""
    model = tiny_vit()
    convert(model, "mita", num_landmarks=64, topk=65)
    attn = model.blocks[0].attn
    assert (attn.num_prefix_tokens, attn.grid) == (1, "auto")
    x = torch.randn(1, 65, 32)
    q, k, v = attn.qkv(x).reshape(1, 65, 3, 2, 16).permute(2, 0, 3, 1, 4)
    expected = mita_attention(q, k, v, num_landmarks=64, topk=65, grid=(8, 8), num_prefix_tokens=1)
    expected = attn.proj(expected.transpose(1, 2).reshape(1, 65, 32))
    with torch.no_grad():
        torch.testing.assert_close(attn(x), expected)


def test_mita_convert_is_exposed_on_the_package():
    assert mita.convert is convert


def test_convert_non_square_grid_and_other_method_options():
    model = tiny_vit(img_size=(32, 16))
    convert(model, "mita", num_landmarks=(2, 2), topk=4)
    assert model.blocks[0].attn.grid == (8, 4)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 16)).shape == (1, 5)


def test_convert_refuses_to_drop_extras():
    model = timm.create_model("mita_deit_tiny_patch16_224_dwc", depth=1)
    with pytest.raises(ValueError, match=r"drop its modules \['dwc'\]"):
        revert(model)
    assert isinstance(model.blocks[0].attn, MiTAVisionAttention)  # nothing was swapped
    convert(model, "mita", dwc=True, topk=9)  # keeps the dwc weights
    assert model.blocks[0].attn.topk == 9


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("not a model",), {}, TypeError, "torch.nn.Module"),
        ((torch.nn.Linear(2, 2),), {}, ValueError, "no timm Attention"),
        ((None, 3), {}, TypeError, "attention must be"),
        ((None, "nope"), {}, ValueError, "not a registered attention"),
        ((None, "timm"), {"topk": 3}, ValueError, "takes no options"),
        ((None, "sdpa"), {"dwc": True}, ValueError, r"'sdpa' takes no options \['dwc'\]"),
        ((None, "mita"), {"grid": None, "dwc": True}, ValueError, "dwc=True needs a patch grid"),
        ((None, "mita"), {"bogus": 1}, ValueError, r"convert\(\): attention 'mita' takes no options \['bogus'\]"),
        ((None, "mita:bogus=2"), {}, ValueError, r"takes no options \['bogus'\]"),
    ],
    ids=[
        "not-module",
        "no-attention",
        "bad-attention-type",
        "unknown-name",
        "timm-options",
        "dwc-on-sdpa",
        "dwc-1d",
        "bogus-option",
        "bogus-config-option",
    ],
)
def test_convert_errors(args, kwargs, error, match):
    args = tuple(tiny_vit() if a is None else a for a in args[:1]) + args[1:]
    with pytest.raises(error, match=match):
        convert(*args, **kwargs)


def authors_attention(sd: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """The authors' MiTA-DeiT gated attention, written from their description on raw tensors."""
    B, N, C = x.shape
    D, side = C // heads, int(N**0.5)
    q, k, v, g = F.linear(x, sd["qkvg.weight"], sd["qkvg.bias"]).reshape(B, N, 4, heads, D).permute(2, 0, 3, 1, 4)
    pooled = q[:, :, :-1].permute(0, 1, 3, 2).reshape(B, C, side, side)  # CLS in, last patch out
    landmarks = F.adaptive_avg_pool2d(pooled, 5).reshape(B, heads, D, 25).transpose(-1, -2)
    options = {"num_landmarks": 25, "topk": 25, "landmark_scale": D**-1.0, "impl": "reference"}
    out = mita_attention(q, k, v, landmarks=landmarks, **options)
    out = out.transpose(1, 2).reshape(B, N, C)
    patches = v[:, :, 1:].transpose(1, 2).reshape(B, side, side, C).permute(0, 3, 1, 2)
    local = F.conv2d(patches, sd["dwc.weight"], sd["dwc.bias"], padding=1, groups=C).flatten(2).transpose(1, 2)
    out = (out + F.pad(local, (0, 0, 1, 0))) * F.silu(g.transpose(1, 2).reshape(B, N, C))
    return F.linear(out, sd["proj.weight"], sd["proj.bias"])


def test_authors_checkpoint_layout_gives_their_outputs():
    """A timm DeiT-Tiny state dict plus ``dwc`` and a fused ``qkvg`` (the authors' layout) loads strictly."""
    deit = timm.create_model("deit_tiny_patch16_224", depth=2)
    sd = deit.state_dict()
    for i in range(2):
        p = f"blocks.{i}.attn."
        sd[p + "qkvg.weight"] = torch.cat([sd.pop(p + "qkv.weight"), torch.randn(192, 192) * 0.05])
        sd[p + "qkvg.bias"] = torch.cat([sd.pop(p + "qkv.bias"), torch.randn(192) * 0.05])
        sd[p + "dwc.weight"], sd[p + "dwc.bias"] = torch.randn(192, 1, 3, 3) * 0.1, torch.randn(192) * 0.1
    model = timm.create_model("mita_deit_tiny_patch16_224_dwc_gate", depth=2, compat="official").eval()
    model.load_state_dict(dict(sd), strict=True)
    x = torch.randn(2, 197, 192)
    block = {k.removeprefix("blocks.0.attn."): v for k, v in sd.items() if k.startswith("blocks.0.attn.")}
    with torch.no_grad():
        torch.testing.assert_close(model.blocks[0].attn(x), authors_attention(block, x, heads=3))
        assert torch.isfinite(model(torch.randn(1, 3, 224, 224))).all()


@pytest.mark.parametrize("name", [n for n in mita.attention.names() if n != "sdpa"])
def test_convert_to_every_registered_method(name):
    model = tiny_vit()
    convert(model, name)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 32, 32))).all()
    if name in LAYER_EXTRAS:  # its learned parts have no place in timm's Attention
        with pytest.raises(ValueError, match="would drop its modules"):
            revert(model)
        return
    revert(model)


def test_import_mita_registers_lazily():
    """``import mita`` does not import timm; importing timm afterwards registers the names."""
    script = (
        "import sys, mita; assert 'timm' not in sys.modules; import timm; "
        "assert timm.is_model('mita_deit_tiny_patch16_224')"
    )
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_hook_without_timm(monkeypatch):
    from mita.integrations import timm_hook

    monkeypatch.setitem(sys.modules, "timm", None)  # as if timm were not installed
    before = list(sys.meta_path)
    timm_hook.install()
    assert sys.meta_path == before


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_timm_state_dict_loads_strictly(name):
    timm_layer = TimmAttention(32, 4, qkv_bias=True)
    layer = registry.build_layer(name, 32, 4, qkv_bias=True)
    if name in LAYER_EXTRAS:  # strictly but for the layer's own modules
        result = layer.load_state_dict(timm_layer.state_dict(), strict=False)
        assert {k.split(".")[0] for k in result.missing_keys} == LAYER_EXTRAS[name] and not result.unexpected_keys
        return
    layer.load_state_dict(timm_layer.state_dict())
    if name == "sdpa":  # same weights, same attention: same output as timm
        x = torch.randn(2, 10, 32)
        torch.testing.assert_close(layer(x), timm_layer(x))


@pytest.mark.parametrize(
    "options",
    [
        {"agent_bias": True, "grid": (4, 4), "num_prefix_tokens": 1, "num_agents": 4},
        {"agent_bias": True, "seq_len": 17, "num_prefix_tokens": 1},
        {"dwc": True, "grid": "auto", "num_prefix_tokens": 1, "num_agents": 4},
        {"dwc": True},
        {"agent_bias": True, "dwc": True, "grid": (4, 4), "num_prefix_tokens": 1, "num_agents": (2, 2)},
    ],
    ids=["bias-2d", "bias-1d", "dwc-2d", "dwc-1d", "bias-dwc"],
)
def test_agent_layer_options_load_timm_missing_only_their_parameters(options):
    layer = registry.build_layer({"name": "agent", **options}, 32, 4)
    extra = {n for n, _ in layer.named_parameters() if n.startswith(("agent_bias.", "dwc."))}
    assert extra
    result = layer.load_state_dict(TimmAttention(32, 4).state_dict(), strict=False)
    assert set(result.missing_keys) == extra and not result.unexpected_keys
    x = torch.randn(2, 17, 32, requires_grad=True)
    mask = padding(2, 17, [17, 15])
    out = layer(x, attn_mask=mask)
    out.sum().backward()
    assert (out[1, 15:] == layer.proj.bias).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_importing_convert_first_registers_the_models_without_a_warning() -> None:
    """convert.py imports timm, whose import hook imports deit.py, which needs convert: no cycle error."""
    code = "import timm, mita.models.convert; timm.create_model('mita_deit_tiny_patch16_224', pretrained=False)"
    code = "from mita.models.convert import convert; " + code
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
