"""ViT-5 and MiTA-ViT-5 in timm's registry: the model's RoPE, the authors' MiTA written out on raw
tensors, their checkpoint layout, forward and backward at several image sizes, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")

import mita  # noqa: E402,F401  (registers the models)
from mita.layers import MiTAVisionAttention  # noqa: E402
from mita.models.vit5 import MODEL_NAMES, ViT5RotaryEmbedding  # noqa: E402

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)  # D = 16, 4x4 patches


def tiny(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, **{**TINY, **kwargs})


def test_names_are_registered():
    assert set(MODEL_NAMES) == {
        "vit5_small",
        "vit5_base",
        "mita_vit5_small",
        "mita_vit5_small_dwc",
        "mita_vit5_base",
        "mita_vit5_base_dwc",
    }
    assert set(timm.list_models("*vit5*")) >= set(MODEL_NAMES)


def test_small_is_the_papers_layout():
    model = timm.create_model("mita_vit5_small_dwc", pretrained=False, depth=1)
    attn = model.blocks[0].attn
    assert (model.embed_dim, model.blocks[0].attn.num_heads, model.reg_token.shape[1]) == (384, 6, 4)
    assert isinstance(attn, MiTAVisionAttention) and attn.dwc is not None and attn.qkv.bias is None
    assert (attn.num_landmarks, attn.topk, attn.num_routed, attn.grid) == (25, 30, 1, "auto")
    assert (attn.num_prefix_tokens, attn.num_suffix_tokens) == (1, 4)
    assert isinstance(model.blocks[0].norm1, timm.layers.RmsNorm) and isinstance(attn.q_norm, timm.layers.RmsNorm)
    torch.testing.assert_close(model.blocks[0].gamma_1, torch.full((384,), 1e-4))


def _rotate_complex(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (..., n, D) turned by angles (n, D/2), channel pairs (2i, 2i + 1) as complex numbers."""
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def _angles(grid, reference, d, theta):
    """The ViT-5 authors' angles in words: per axis d/4 frequencies theta^(-4j/d) at positions
    0..g-1 rescaled to the reference size; the row's pairs first, then the column's."""
    freqs = theta ** (-4 * torch.arange(d // 4, dtype=torch.float64) / d)
    rows = torch.arange(grid[0], dtype=torch.float64) * reference[0] / grid[0]
    cols = torch.arange(grid[1], dtype=torch.float64) * reference[1] / grid[1]
    r, c = torch.meshgrid(rows, cols, indexing="ij")
    return torch.cat([r.reshape(-1, 1) * freqs, c.reshape(-1, 1) * freqs], dim=-1)


@pytest.mark.parametrize("grid", [(4, 4), (6, 3)], ids=["reference", "other-grid"])
def test_rope_is_the_authors_2d_rope_with_registers_on_their_own_grid(grid):
    rope = ViT5RotaryEmbedding(16, (4, 4), num_registers=4)(grid)
    x = torch.randn(3, grid[0] * grid[1] + 4, 16, dtype=torch.float64)
    expected = torch.cat(
        [
            _rotate_complex(x[:, :-4], _angles(grid, (4, 4), 16, 10000.0)),
            _rotate_complex(x[:, -4:], _angles((2, 2), (2, 2), 16, 100.0)),
        ],
        dim=1,
    )
    from mita.layers.base import rotate

    torch.testing.assert_close(rotate(x, rope.double(), half=False), expected, rtol=1e-6, atol=1e-6)


def _authors_mita(q, k, v, side: int, m_side: int, topk: int, dwc=None):
    """MiTA-ViT-5 as the spec words the authors' code: landmarks pooled from the patch queries (token 1 to
    N - 5) on their square, experts of the top-k keys among all N, the shared expert's values at D^-1/2,
    each query routed to its best landmark, one softmax over [landmark logits / D ; expert keys at D^-1/2]."""
    B, H, N, D = q.shape
    patches = q[:, :, 1 : N - 4].transpose(-1, -2).reshape(B * H, D, side, side)
    lm = F.adaptive_avg_pool2d(patches, m_side).reshape(B, H, D, -1).transpose(-1, -2)  # (B, H, m, D)
    affinity = lm @ k.transpose(-1, -2)  # (B, H, m, N)
    shared_v = torch.softmax(affinity * D**-0.5, -1) @ v
    experts = affinity.topk(topk, dim=-1).indices  # (B, H, m, k)
    route = (q @ lm.transpose(-1, -2)).argmax(-1)  # (B, H, N)
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                keys = experts[b, h, route[b, h, i]]
                logits = torch.cat([lm[b, h] @ q[b, h, i] / D, k[b, h, keys] @ q[b, h, i] * D**-0.5])
                out[b, h, i] = torch.softmax(logits, 0) @ torch.cat([shared_v[b, h], v[b, h, keys]])
    if dwc is not None:
        img = v[:, :, 1 : N - 4].transpose(-1, -2).reshape(B, H * D, side, side)
        local = dwc(img).reshape(B, H, D, -1).transpose(-1, -2)
        out = out + F.pad(local, (0, 0, 1, 4))
    return out


@pytest.mark.parametrize("dwc", [False, True], ids=["plain", "dwc"])
def test_official_compat_is_the_authors_mita(dwc):
    """compat="official": the authors' MiTA-ViT-5 attention on the rotated q, k, v, 6x6 patches, m = 4, k = 7."""
    model = tiny(
        "mita_vit5_small" + ("_dwc" if dwc else ""), img_size=48, num_landmarks=4, topk=7, compat="official"
    ).double()
    attn = model.blocks[0].attn
    q, k, v = (torch.randn(2, 2, 1 + 36 + 4, 16, dtype=torch.float64) for _ in range(3))
    expected = _authors_mita(q, k, v, 6, 2, 7, attn.dwc)
    torch.testing.assert_close(attn.attend(q, k, v, None, False), expected, rtol=1e-10, atol=1e-12)


def test_mita_vit5_with_every_key_is_vit5():
    """The routed branch alone with one expert holding every key is softmax attention: same weights, same outputs."""
    dense = tiny("vit5_small").double().eval()
    model = tiny("mita_vit5_small", num_landmarks=1, topk=1 + 16 + 4, branches="routed").double().eval()
    model.load_state_dict(dense.state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), dense.forward_features(x), rtol=1e-10, atol=1e-12)


#: the parameter names of the authors' ViT-5 code (one block), without their RoPE frequency buffers
AUTHORS_KEYS = {
    "cls_token",
    "reg_token",
    "pos_embed",
    "patch_embed.proj.weight",
    "patch_embed.proj.bias",
    "blocks.0.gamma_1",
    "blocks.0.gamma_2",
    "blocks.0.norm1.weight",
    "blocks.0.attn.qkv.weight",
    "blocks.0.attn.q_norm.weight",
    "blocks.0.attn.k_norm.weight",
    "blocks.0.attn.proj.weight",
    "blocks.0.attn.proj.bias",
    "blocks.0.norm2.weight",
    "blocks.0.mlp.fc1.weight",
    "blocks.0.mlp.fc1.bias",
    "blocks.0.mlp.fc2.weight",
    "blocks.0.mlp.fc2.bias",
    "norm.weight",
    "head.weight",
    "head.bias",
}


@pytest.mark.parametrize("name", ["vit5_small", "mita_vit5_small_dwc"])
def test_authors_checkpoint_layout_loads(name, tmp_path):
    """Their names, their {"model": state_dict} file with RoPE frequency buffers: loads strictly, same outputs."""
    source = tiny(name, depth=1).eval()
    state = source.state_dict()
    extra = {"blocks.0.attn.dwc.weight", "blocks.0.attn.dwc.bias"} if "dwc" in name else set()
    assert set(state) == AUTHORS_KEYS | extra
    freqs = {"blocks.0.attn.rope.freqs": torch.ones(4), "blocks.0.attn.rope_reg.freqs": torch.ones(4)}
    torch.save({"model": {**state, **freqs}, "epoch": 799}, tmp_path / "checkpoint.pth")
    loaded = timm.create_model(
        name,
        pretrained=True,
        pretrained_cfg_overlay={"file": str(tmp_path / "checkpoint.pth"), "num_classes": 5},
        **{**TINY, "depth": 1},
    ).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), source(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "kwargs", "image"),
    [
        ("vit5_small", {}, (32, 32)),
        ("mita_vit5_small", {"num_landmarks": 4, "topk": 6}, (32, 32)),
        ("mita_vit5_small_dwc", {"num_landmarks": 4, "topk": 6, "img_size": (32, 48)}, (32, 48)),
        ("mita_vit5_base", {"num_landmarks": 9, "topk": 8, "img_size": 64, "global_pool": "avg"}, (64, 64)),
        ("mita_vit5_small_dwc", {"num_landmarks": 4, "topk": 6, "dynamic_img_size": True}, (48, 24)),
        ("vit5_base", {"dynamic_img_size": True}, (64, 40)),
    ],
    ids=["vit5-32", "mita-32", "mita-dwc-32x48", "mita-base-64-avg", "mita-dwc-dynamic-48x24", "vit5-dynamic-64x40"],
)
def test_forward_and_backward_at_several_sizes(name, kwargs, image):
    model = tiny(name, **kwargs).train()
    x = torch.randn(2, 3, *image)
    out = model(x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    F.cross_entropy(out, torch.tensor([0, 3])).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.pos_embed.grad.abs().sum() > 0 and model.reg_token.grad.abs().sum() > 0


def test_a_dynamic_model_pools_each_image_on_its_grid():
    """With dynamic_img_size, a 48x24 image is 6x3 patches: MiTA pools on that grid, RoPE is rescaled to it."""
    model = tiny("mita_vit5_small", num_landmarks=4, topk=6, dynamic_img_size=True).eval()
    attn = model.blocks[0].attn
    attn.record_routing = True
    with torch.no_grad():
        model(torch.randn(1, 3, 48, 24))
        q = attn.routing.landmarks
    assert q.shape[2] == 4 and attn.patch_grid.current == (6, 3)


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "match"),
    [
        (
            "vit5_small",
            {"num_landmarks": 4},
            ValueError,
            r"standard attention and takes no MiTA options \['num_landmarks'\]",
        ),
        ("vit5_small", {"num_registers": 3}, ValueError, "num_registers must be a perfect square"),
        ("vit5_small", {"global_pool": "map"}, ValueError, "global_pool must be 'token' or 'avg'"),
        ("vit5_small", {"embed_dim": 36, "num_heads": 6}, ValueError, "multiple of 4"),
        ("mita_vit5_small", {"num_landmarks": 5}, ValueError, "perfect square"),
        ("mita_vit5_small", {"pretrained": True}, ValueError, "has no downloadable weights"),
    ],
    ids=["mita-option-on-dense", "registers", "pool", "head-dim", "landmarks", "pretrained"],
)
def test_refusals(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        timm.create_model(name, **{**TINY, "depth": 1, **kwargs})


def test_rope_period_of_the_registers():
    """The registers' base is 100: the second register (column 1) turns its first pair by 1 radian."""
    rope = ViT5RotaryEmbedding(16, (4, 4))((4, 4))
    sin = rope[16 + 1, :16]
    assert math.isclose(float(sin[8]), math.sin(1.0), rel_tol=1e-6) and float(sin[0]) == 0.0


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny("mita_vit5_small", num_landmarks=4, topk=6).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grads = []
    for enable in (False, True):
        model.set_grad_checkpointing(enable)
        model.zero_grad()
        model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
