"""LRA models (encoder classifier, dual encoder, attention options) and named configurations."""

from __future__ import annotations

import re

import pytest
import torch

from mita_experiments.lra.config import TASKS, load_config, variants
from mita_experiments.lra.models import Classifier, Encoder, set_attention_options, sinusoidal

MITA = "mita:num_landmarks=4,topk=4"


def small(attention="sdpa", **kw):
    args = dict(
        vocab_size=12,
        max_length=24,
        dim=16,
        depth=2,
        num_heads=2,
        mlp_dim=32,
        attention=attention,
        dropout=0.0,
        attn_dropout=0.0,
    )
    return Classifier(num_classes=3, **{**args, **kw}).eval()


@pytest.mark.parametrize("attention", ["sdpa", MITA], ids=["sdpa", "mita"])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_padding_does_not_change_the_output(attention, pooling, positions):
    """Extra padding after a sequence changes nothing: the mask hides it from attention and pooling."""
    model = small(attention, pooling=pooling, positions=positions)
    tokens = torch.randint(1, 12, (2, 10))
    padded = torch.cat([tokens, torch.zeros(2, 14, dtype=torch.long)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), model(padded), rtol=1e-5, atol=1e-5)


def test_mita_cls_token_is_not_pooled():
    model = small(MITA, pooling="cls")
    assert model.encoder.blocks[0].attn.num_prefix_tokens == 1
    assert small(MITA, pooling="mean").encoder.blocks[0].attn.num_prefix_tokens == 0


def test_dual_encoder_features():
    model = small(dual=True)
    a, b = torch.randint(1, 12, (2, 8)), torch.randint(1, 12, (2, 8))
    with torch.no_grad():
        e1, e2 = model.encoder(a), model.encoder(b)
        expected = model.head(torch.cat([e1, e2, e1 * e2, e1 - e2], dim=-1))
        torch.testing.assert_close(model(a, b), expected)
    with pytest.raises(ValueError, match="tokens2"):
        model(a)
    with pytest.raises(ValueError, match="tokens2"):
        small()(a, b)


def test_set_attention_options_changes_every_layer():
    model = small(MITA)
    assert set_attention_options(model, topk=8, num_landmarks=6) == 2
    assert all(b.attn.topk == 8 and b.attn.num_landmarks == 6 for b in model.encoder.blocks)
    with pytest.raises(ValueError, match="no option 'bogus'"):
        set_attention_options(model, bogus=1)
    with pytest.raises(ValueError, match="no attention layer"):
        set_attention_options(torch.nn.Linear(2, 2), topk=1)


def test_sinusoidal_table():
    table = sinusoidal(5, 6)
    assert table.shape == (5, 6)
    assert torch.allclose(table[:, 0], torch.sin(torch.arange(5.0)))
    assert torch.allclose(table[:, 1], torch.cos(torch.arange(5.0)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pooling": "max"}, "pooling"),
        ({"positions": "rope"}, "positions"),
        ({"depth": 0}, "depth"),
        ({"attention": "nope"}, "not a registered attention"),
    ],
    ids=["pooling", "positions", "depth", "attention"],
)
def test_model_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Encoder(vocab_size=12, max_length=8, **kwargs)


def test_too_long_input_is_refused():
    with pytest.raises(ValueError, match="max_length 24"):
        small()(torch.ones(1, 30, dtype=torch.long))


@pytest.mark.parametrize("task", TASKS)
def test_every_task_has_the_three_variants(task):
    assert variants(task) == ["lra", "small", "cpu"]
    for variant in variants(task):
        config = load_config(task, variant)
        assert {"batch_size", "steps", "lr", "schedule"} <= set(config["train"])
        Encoder(vocab_size=20, max_length=16, **{**config["model"], "depth": 1})  # every model section builds


def test_config_overrides_and_errors(tmp_path):
    config = load_config("listops", "small", ["train.steps=7", "model.pooling=cls"])
    assert config["train"]["steps"] == 7 and config["model"]["pooling"] == "cls"
    with pytest.raises(ValueError, match="unknown key 'stpes'"):
        load_config("listops", "small", ["train.stpes=7"])
    with pytest.raises(ValueError, match=re.escape("section.key=value")):
        load_config("listops", "small", ["steps=7"])
    with pytest.raises(ValueError, match="variant must be one of"):
        load_config("listops", "huge")
    with pytest.raises(ValueError, match="task must be one of"):
        load_config("chess")
    with pytest.raises(FileNotFoundError, match="config file"):
        load_config("listops", path=tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config("listops", path=tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text('{"model": {}}')
    with pytest.raises(ValueError, match="lacks the section"):
        load_config("listops", path=tmp_path / "partial.json")
