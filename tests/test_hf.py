"""Hugging Face integration: attn_implementation="mita" on tiny random ViT and BERT models."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModel, BertConfig, LlamaConfig, ViTConfig  # noqa: E402

from mita.integrations.hf import key_padding_mask, mita_attention_forward, mita_options  # noqa: E402
from mita.ops.mita import mita_attention  # noqa: E402


def vit_config(**kwargs) -> ViTConfig:
    args = dict(image_size=32, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    return ViTConfig(**{**args, "intermediate_size": 64, **kwargs})


def bert_config(**kwargs) -> BertConfig:
    args = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    return BertConfig(**{**args, **kwargs})


def capture_self_attention(model: torch.nn.Module, cls_name: str) -> list:
    """Record (module, hidden_states, output) of every self-attention module of the model."""
    calls = []
    for module in model.modules():
        if type(module).__name__ == cls_name:
            module.register_forward_hook(lambda m, args, out: calls.append((m, args[0], out[0])))
    return calls


def expected_attention(module, hidden, options, mask=None, names=("query", "key", "value"), out_proj=None):
    """The module's q, k, v projections, then :func:`mita_attention`, then its output projection if any."""
    B, N, C = hidden.shape
    heads = module.config.num_attention_heads
    q, k, v = (getattr(module, n)(hidden).view(B, N, heads, C // heads).transpose(1, 2) for n in names)
    out = mita_attention(q, k, v, **options, key_padding_mask=mask).transpose(1, 2).reshape(B, N, -1)
    return out if out_proj is None else getattr(module, out_proj)(out)


def test_vit_matches_the_op():
    model = AutoModel.from_config(vit_config(mita_num_landmarks=16, mita_topk=8), attn_implementation="mita").eval()
    calls = capture_self_attention(model, "ViTAttention")
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
        assert len(calls) == 2
        options = dict(num_landmarks=16, topk=8, num_routed=1, grid=(8, 8), num_prefix_tokens=1)
        for module, hidden, out in calls:
            names = ("q_proj", "k_proj", "v_proj")
            expected = expected_attention(module, hidden, options, names=names, out_proj="o_proj")
            torch.testing.assert_close(out, expected)


def test_bert_with_padding_matches_the_op():
    model = AutoModel.from_config(bert_config(mita_num_landmarks=4, mita_topk=6), attn_implementation="mita").eval()
    calls = capture_self_attention(model, "BertSelfAttention")
    ids, mask = torch.randint(0, 50, (2, 20)), torch.ones(2, 20, dtype=torch.long)
    mask[1, 13:] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
        options = dict(num_landmarks=4, topk=6, num_routed=1, grid=None, num_prefix_tokens=0)
        for module, hidden, out in calls:
            torch.testing.assert_close(out, expected_attention(module, hidden, options, mask.bool()))
            assert torch.all(out[1, 13:] == 0)  # padded queries give zero rows
    # without padding the model takes the unmasked path and still matches
    with torch.no_grad():
        calls.clear()
        model(ids)
        for module, hidden, out in calls:
            torch.testing.assert_close(out, expected_attention(module, hidden, options))


def test_bert_trains_a_step():
    model = AutoModel.from_config(bert_config(), attn_implementation="mita")
    out = model(torch.randint(0, 50, (2, 12))).last_hidden_state
    out.square().mean().backward()
    assert model.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "config",
    [
        bert_config(is_decoder=True),
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    ],
    ids=["bert-decoder", "llama"],
)
def test_causal_models_get_a_clear_error(config):
    model = AutoModel.from_config(config, attn_implementation="mita")
    with pytest.raises(ValueError, match="no causal form yet"):
        model(torch.randint(0, 50, (1, 8)))


@pytest.mark.parametrize(
    ("config", "n", "expected"),
    [
        (vit_config(), 65, dict(num_landmarks=25, topk=25, num_routed=1, num_prefix_tokens=1, grid=(8, 8))),
        (vit_config(mita_grid=None, mita_num_landmarks=8), 65, dict(num_landmarks=8, grid=None)),
        (vit_config(mita_grid=[4, 16], mita_num_prefix_tokens=0), 64, dict(grid=(4, 16), num_prefix_tokens=0)),
        (bert_config(), 30, dict(num_landmarks=64, topk=64, num_routed=1, num_prefix_tokens=0, grid=None)),
        (bert_config(mita_num_routed=2), 30, dict(num_routed=2)),
        (vit_config(mita_num_suffix_tokens=4), 69, dict(num_prefix_tokens=1, num_suffix_tokens=4, grid=(8, 8))),
    ],
    ids=["vit-defaults", "vit-1d", "vit-grid", "bert-defaults", "bert-routed", "vit-suffix"],
)
def test_options_from_config(config, n, expected):
    options = mita_options(config, n)
    assert {k: options[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("config", "n", "match"),
    [
        (vit_config(), 51, r"the image's own \(which was not recorded\) or that of the config's image size"),
        (
            bert_config(mita_grid="auto"),
            31,
            "or that of a square; got N - num_prefix_tokens - num_suffix_tokens = 31 - 0 - 0",
        ),
        (vit_config(mita_grid="rows"), 65, "'auto', None or"),
    ],
    ids=["auto-not-the-grid", "auto-not-square", "bad-grid"],
)
def test_option_errors(config, n, match):
    with pytest.raises(ValueError, match=match):
        mita_options(config, n)


def test_mask_formats():
    keys = torch.tensor([[True, True, False], [True, True, True]])
    four_d = keys[:, None, None, :].expand(2, 1, 3, 3)
    additive = torch.zeros(2, 1, 3, 3).masked_fill(~four_d, torch.finfo(torch.float32).min)
    assert torch.equal(key_padding_mask(keys.long(), 2, 3), keys)
    assert torch.equal(key_padding_mask(four_d, 2, 3), keys)
    assert torch.equal(key_padding_mask(additive, 2, 3), keys)
    assert key_padding_mask(torch.ones(2, 3), 2, 3) is None
    assert key_padding_mask(None, 2, 3) is None


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(3, 3, dtype=torch.bool).tril()[None, None].expand(2, 1, 3, 3), ValueError, "only padding masks"),
        (torch.ones(2, 3, 3), ValueError, "2-D"),
        (torch.ones(2, 4), ValueError, "keys are"),
        ([[1, 1, 1]], TypeError, "tensor or None"),
    ],
    ids=["causal-4d", "3d", "wrong-length", "list"],
)
def test_mask_errors(mask, error, match):
    with pytest.raises(error, match=match):
        key_padding_mask(mask, 2, 3)


def test_forward_errors():
    q = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=r"no \.config"):
        mita_attention_forward(module, q, q, q, None)
    module.config = bert_config()
    with pytest.raises(ValueError, match="no causal form yet"):
        mita_attention_forward(module, q, q, q, None, is_causal=True)
    with pytest.raises(ValueError, match="attention weights"):
        mita_attention_forward(module, q, q, q, None, output_attentions=True)
    out, weights = mita_attention_forward(module, q, q, q, None)
    assert out.shape == (1, 4, 2, 8) and weights is None


def test_options_survive_save_and_load(tmp_path):
    model = AutoModel.from_config(bert_config(mita_num_landmarks=4, mita_topk=6), attn_implementation="mita")
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, attn_implementation="mita").eval()
    assert loaded.config._attn_implementation == "mita"
    assert mita_options(loaded.config, 20)["num_landmarks"] == 4 and mita_options(loaded.config, 20)["topk"] == 6
    ids = torch.randint(0, 50, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).last_hidden_state, model.eval()(ids).last_hidden_state)


def test_cross_attention_modules_are_never_self_attention():
    """Equal lengths and a key padding mask: a cross-attention module's queries are all real."""

    class BertCrossAttention(torch.nn.Module):
        config = BertConfig(mita_num_landmarks=3, mita_topk=4)

    class SelfAttention(torch.nn.Module):
        config = BertConfig(mita_num_landmarks=3, mita_topk=4)

    q, k, v = (torch.randn(2, 2, 10, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.arange(10)[None] < torch.tensor([[10], [6]])
    opts = dict(num_landmarks=3, topk=4, num_routed=1, num_prefix_tokens=0, grid=None, key_padding_mask=mask)
    cross, _ = mita_attention_forward(BertCrossAttention(), q, k, v, mask.long())
    everyone = torch.ones(2, 10, dtype=torch.bool)
    expected = mita_attention(q, k, v, **opts, query_padding_mask=everyone).transpose(1, 2)
    torch.testing.assert_close(cross, expected)
    assert cross[1, 6:].abs().sum() > 0
    own, _ = mita_attention_forward(SelfAttention(), q, k, v, mask.long())
    torch.testing.assert_close(own, mita_attention(q, k, v, **opts).transpose(1, 2))
    assert (own[1, 6:] == 0).all()


def without_tracking(model: torch.nn.Module, grid: list[int]) -> torch.nn.Module:
    """A copy of the model that pools on ``config.mita_grid = grid``, whatever the image."""
    fixed = copy.deepcopy(model)
    for module in fixed.modules():
        if hasattr(module, "mita_patch_grid"):
            module.mita_patch_grid = None
    fixed.config.mita_grid = grid
    return fixed


@pytest.mark.parametrize("switched", [False, True], ids=["from_config", "set_attn_implementation"])
@pytest.mark.parametrize(
    ("image", "grid"),
    [((256, 144), [16, 9]), ((144, 256), [9, 16]), ((192, 192), [12, 12])],
    ids=["16x9", "9x16", "12x12"],
)
def test_interpolate_pos_encoding_pools_each_image_on_its_own_grid(image, grid, switched):
    """A 256x144 image is 16x9 patches (144 = 12^2 as the config's 192 px, but not 12x12), its transpose 9x16."""
    config = vit_config(image_size=192, patch_size=16, mita_num_landmarks=[2, 3], mita_topk=12)
    if switched:
        model = AutoModel.from_config(config, attn_implementation="sdpa")
        model.set_attn_implementation("mita")
    else:
        model = AutoModel.from_config(config, attn_implementation="mita")
    x = torch.randn(2, 3, *image)
    with torch.no_grad():
        out = model.eval()(x, interpolate_pos_encoding=True).last_hidden_state
        expected = without_tracking(model, grid)(x, interpolate_pos_encoding=True).last_hidden_state
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_patch_grid_tracking_leaves_other_models_alone():
    bert = AutoModel.from_config(bert_config(), attn_implementation="mita")
    vit = AutoModel.from_config(vit_config(), attn_implementation="sdpa")
    for model in (bert, vit):
        assert not any(hasattr(m, "mita_patch_grid") or m._forward_pre_hooks for m in model.modules())
