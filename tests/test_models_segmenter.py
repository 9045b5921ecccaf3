"""Segmenter (mita.models.segmenter): both decoders, any attention in encoder and decoder, the class
tokens never pooled, sliding-window inference, the attention swap, the Segmenter checkpoint layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("timm")

from mita.layers.mita import MiTAAttention
from mita.models.segmenter import (
    MaskTransformer,
    Segmenter,
    create_segmenter,
    segmenter_state_dict,
)

MITA = "mita:num_landmarks=4,topk=6"
K = 5  # classes


def tiny(decoder: str = "mask_transformer", attention: str = MITA, decoder_attention: str = MITA) -> Segmenter:
    """A 2-block ViT with 8 px patches at 32 px (a 4x4 grid) and a 1-block decoder, in eval mode."""
    torch.manual_seed(0)
    model = create_segmenter(
        "tiny",
        num_classes=K,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=48,
        num_heads=2,
        decoder=decoder,
        attention=attention,
        decoder_attention=decoder_attention,
        decoder_depth=1,
    )
    return model.eval()


@pytest.mark.parametrize("decoder", ["mask_transformer", "linear"])
@pytest.mark.parametrize("size", [(32, 32), (32, 48), (30, 37)])
def test_shapes_any_size(decoder, size):
    """Logits at the input's size; sides off the patch size are padded inside and cropped back."""
    model = tiny(decoder)
    out = model(torch.randn(2, 3, *size))
    assert out.shape == (2, K, *size)
    assert torch.isfinite(out).all()


def test_layers_pool_the_patches_on_their_grid():
    """Encoder MiTA: 1 prefix (CLS); decoder MiTA: the K class tokens are its prefix; one live grid for both."""
    model = tiny()
    enc = [m for m in model.encoder.modules() if isinstance(m, MiTAAttention)]
    dec = [m for m in model.decoder.modules() if isinstance(m, MiTAAttention)]
    assert len(enc) == 2 and len(dec) == 1
    assert {m.num_prefix_tokens for m in enc} == {1} and dec[0].num_prefix_tokens == K
    assert (enc[0].num_landmarks, enc[0].topk) == (4, 6)
    model(torch.randn(1, 3, 32, 48))
    assert all(m.patch_grid is model.patch_grid for m in enc + dec)
    assert model.patch_grid.current == (4, 6)
    assert dec[0].resolve_grid(K + 24) == (4, 6) and enc[0].resolve_grid(1 + 24) == (4, 6)


def test_class_tokens_never_pooled():
    """The first decoder block's landmarks are the pooled patch queries: other class embeddings leave them unchanged."""
    model = tiny()
    layer = model.decoder.blocks[0].attn
    layer.record_routing = True
    images = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        model(images)
        before = layer.routing.landmarks.clone()
        model.decoder.cls_emb.normal_(std=5.0)
        model(images)
    torch.testing.assert_close(layer.routing.landmarks, before, rtol=0, atol=0)
    # and they are the 2x2 average pools of the patch queries on the 4x4 grid
    captured = {}
    hook = model.decoder.blocks[0].register_forward_pre_hook(lambda _, args: captured.update(x=args[0]))
    with torch.no_grad():
        model(images)
    hook.remove()
    x = model.decoder.blocks[0].norm1(captured["x"])
    q = layer.qkv(x).unflatten(-1, (3, layer.num_heads, layer.head_dim))[:, :, 0].transpose(1, 2)  # (B, H, N, D)
    patches = q[:, :, K:].transpose(-1, -2).unflatten(-1, (4, 4))  # (B, H, D, 4, 4)
    pooled = F.adaptive_avg_pool2d(patches.flatten(0, 1), 2).flatten(-2).transpose(-1, -2)
    torch.testing.assert_close(layer.routing.landmarks[0], pooled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decoder", ["mask_transformer", "linear"])
@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_slide_equals_whole_image_when_the_window_covers_it(decoder, size):
    model = tiny(decoder)
    images = torch.randn(2, 3, *size)
    with torch.no_grad():
        whole = model(images)
    torch.testing.assert_close(model.slide(images, 64, 16), whole, rtol=0, atol=0)
    torch.testing.assert_close(model.slide(images, max(size)), whole, rtol=0, atol=0)


def test_slide_averages_the_windows():
    """Overlapping windows (the last one moved in to end at the border): each pixel the mean of its windows."""
    model = tiny()
    images = torch.randn(2, 3, 32, 56)
    out = model.slide(images, 32, stride=(16, 20), batch_size=3)
    total, count = torch.zeros(2, K, 32, 56), torch.zeros(32, 56)
    with torch.no_grad():
        for c in (0, 20, 24):  # columns: 0, 20, then 56 - 32 = 24; one row
            total[..., c : c + 32] += model(images[..., c : c + 32])
            count[:, c : c + 32] += 1
    torch.testing.assert_close(out, total / count, rtol=1e-5, atol=1e-5)


def test_swap_keeps_the_weights():
    """An SDPA-trained model run with MiTA and back: the state dict is unchanged, and so is the output."""
    model = tiny(attention="sdpa", decoder_attention="sdpa")
    images = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        before, state = model(images), {k: v.clone() for k, v in model.state_dict().items()}
        model.set_attention(MITA, decoder=MITA)
        swapped = model(images)
        assert sum(isinstance(m, MiTAAttention) for m in model.modules()) == 3
        assert model.state_dict().keys() == state.keys()
        model.set_attention("timm", decoder="timm")
        torch.testing.assert_close(model(images), before)
    assert torch.isfinite(swapped).all() and not torch.allclose(swapped, before)


@pytest.mark.parametrize("attention", ["sdpa", "agent:num_agents=4", "nystrom:num_landmarks=4", "topk:topk=4"])
def test_any_registered_attention(attention):
    model = tiny(attention=attention, decoder_attention=attention)
    out = model(torch.randn(1, 3, 32, 40))
    assert out.shape == (1, K, 32, 40) and torch.isfinite(out).all()


def test_trains():
    """A gradient reaches every parameter, through MiTA in the encoder and the decoder."""
    model = tiny().train()
    loss = F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.randint(K, (2, 32, 32)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def _segmenter_code_keys(depth: int, decoder_depth: int) -> set[str]:
    """The parameter names of the Segmenter code's ViT encoder and Mask Transformer (read from its source)."""
    names = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
    block = [f"{n}.{w}" for n in names for w in ("weight", "bias")]
    keys = {"encoder.cls_token", "encoder.pos_embed"} | {f"encoder.patch_embed.proj.{w}" for w in ("weight", "bias")}
    keys |= {f"encoder.norm.{w}" for w in ("weight", "bias")} | {f"encoder.head.{w}" for w in ("weight", "bias")}
    keys |= {f"encoder.blocks.{i}.{b}" for i in range(depth) for b in block}
    keys |= {"decoder.cls_emb", "decoder.proj_patch", "decoder.proj_classes"}
    keys |= {f"decoder.{n}.{w}" for n in ("proj_dec", "decoder_norm", "mask_norm") for w in ("weight", "bias")}
    return keys | {f"decoder.blocks.{i}.{b}" for i in range(decoder_depth) for b in block}


def test_segmenter_checkpoint_layout():
    model = tiny(attention="sdpa", decoder_attention="sdpa")
    state = {k: torch.zeros(()) for k in _segmenter_code_keys(2, 1)}
    assert set(segmenter_state_dict(state)) == set(model.state_dict())
    real = {k: v.clone() for k, v in model.state_dict().items()}
    real["encoder.head.weight"] = torch.zeros(1000, 48)
    mita = tiny()  # the same names with MiTA: its layers keep timm's qkv / proj
    mita.load_state_dict(segmenter_state_dict(real))
    with pytest.raises(ValueError, match="distilled"):
        segmenter_state_dict({**state, "encoder.dist_token": torch.zeros(1, 1, 48)})
    with pytest.raises(TypeError, match="dict of tensors"):
        segmenter_state_dict({"model": state})


def test_refusals():
    with pytest.raises(ValueError, match="size must be one of"):
        create_segmenter("huge")
    with pytest.raises(ValueError, match="decoder must be"):
        tiny(decoder="fcn")
    with pytest.raises(TypeError, match="VisionTransformer"):
        Segmenter(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a registered attention"):
        tiny(attention="nope")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MaskTransformer(48, K, num_heads=5)
    model = tiny("linear")
    with pytest.raises(ValueError, match="linear decoder has no attention"):
        model.set_attention(decoder="sdpa")
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        model(torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match="stride"):
        model.slide(torch.randn(1, 3, 32, 32), 16, 0)
