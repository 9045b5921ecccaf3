"""FLOP tables: the counted full model against closed forms, MiTA's formula, the command."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("timm")

from mita import attention as registry
from mita_experiments.cli import main
from mita_experiments.vision import flops

TINY = flops.Backbone("tiny", embed_dim=32, depth=2, num_heads=2, img_size=64, m=4, num_classes=10)


def test_full_model_matches_closed_form():
    """Per layer 24 N C^2 (qkv, proj, 4x MLP) + 4 N^2 C (attention); patch embedding; head on CLS."""
    total, attn, params = flops.full_model_flops(TINY)
    n, c = TINY.tokens, TINY.embed_dim
    assert n == 17
    assert attn == TINY.depth * 4 * n * n * c
    expected = TINY.depth * (24 * n * c * c + 4 * n * n * c) + 2 * (n - 1) * c * 3 * 16 * 16 + 2 * c * 10
    assert total == expected
    assert params > 0


def test_selection_ops_closed_form():
    n, d, m, k = 1025, 64, 49, 49
    expected = m * n * math.log2(k) + n * m + 2 * m * k * d
    assert flops.selection_ops(n, d, m, k) == pytest.approx(expected)
    assert flops.mita_formula_flops(n, d, m, k) == pytest.approx(n * d * (8 * m + 4 * k) + expected)
    assert flops.selection_ops(10, 4, 2, 64) == flops.selection_ops(10, 4, 2, 10)  # k clamps to N


def test_counted_mita_is_near_the_formula():
    counted = flops.mita_counted_flops(65, 16, 2, 16, 16)
    formula = flops.mita_formula_flops(65, 16, 16, 16)
    assert formula <= counted <= 2 * formula


def test_backbone_row_reduction():
    row = flops.backbone_row(TINY, counted=False)
    assert row["reduction (%)"] == pytest.approx(100 * (1 - row["MiTA GFLOPs"] / row["full GFLOPs"]))
    assert "MiTA GFLOPs (counted impl)" not in row


def test_method_flops_cover_the_registry():
    table = flops.method_flops_per_head([64, 128])
    assert set(table) == {m.name for m in registry.methods() if m.flops is not None}
    assert table["sdpa"] == [4 * 64 * 64 * 64, 4 * 128 * 128 * 64]


def test_markdown_table():
    assert flops.markdown_table([{"a": 1, "b": 0.5}]) == "| a | b |\n|---|---|\n| 1 | 0.50 |\n"


def test_flops_command_writes_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(flops, "TABLE_BACKBONES", [TINY, flops.Backbone("tiny512", 32, 1, 2, 128, 4, num_classes=0)])
    monkeypatch.setattr(flops, "length_sweep", lambda: [flops.backbone_row(TINY, counted=False)])
    monkeypatch.setattr(flops, "vit5_rows", lambda: [{"model": "vit5 stand-in", "N": 1}])
    out = tmp_path / "flops"
    assert main(["vision", "flops", "--out", str(out), "--no-counted"]) == 0
    text = (out / "report.md").read_text()
    assert "up to 42%" in text and "tiny512" in text and "MiTA-ViT-5-S" in text and "vit5 stand-in" in text
    assert (out / "flops_vs_length.png").stat().st_size > 0
    assert main(["vision", "flops", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


def test_length_sweep_grows_with_n():
    rows = flops.length_sweep((64, 128), m=4)
    assert [r["N"] for r in rows] == [17, 65]
    assert rows[1]["reduction (%)"] > rows[0]["reduction (%)"]


def test_vit5_rows_count_registers_and_grow_with_the_image():
    """ViT-5-S: N counts CLS, patches and the 4 registers; its dense part is the full model's less 4 N^2 D
    per head and layer, and MiTA (m = 25, k = 30) saves more as the image grows."""
    rows = flops.vit5_rows((224, 384))
    assert [r["N"] for r in rows] == [14 * 14 + 5, 24 * 24 + 5]
    assert 0 < rows[0]["reduction (%)"] < rows[1]["reduction (%)"] < rows[1]["attention share (%)"]
    assert abs(rows[0]["MiTA GFLOPs (counted impl)"] - rows[0]["MiTA GFLOPs"]) < 0.05 * rows[0]["MiTA GFLOPs"]
