"""``mita vision bench``: whole timm DeiTs converted to MiTA vs unconverted, and the shared alternating-rounds timer."""

from __future__ import annotations

import csv
import itertools

import pytest
import torch

pytest.importorskip("timm")

from mita_experiments.benchmarks.timing import alternating_rounds
from mita_experiments.cli import main
from mita_experiments.vision import bench

TINY = "deit_tiny_patch16_224"
FAST = ["--models", TINY, "--model-args", "depth=2", "--rounds", "1", "--threads", "1"]


def test_alternating_rounds_times_each_call_once_per_round_in_turn(monkeypatch):
    clock = itertools.count(0.0, 0.5)  # every perf_counter read is 0.5 s after the previous one
    monkeypatch.setattr("mita_experiments.benchmarks.timing.time.perf_counter", lambda: next(clock))
    order: list[str] = []
    seen: list[tuple[int, dict[str, float]]] = []
    calls = {"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or torch.ones(2)}
    rounds = alternating_rounds(calls, 3, warmup=2, on_round=lambda r, s: seen.append((r, s)))
    assert order == ["a", "b"] * 5  # two warm-up calls each, then three alternating rounds
    assert rounds.times == {"a": [0.5] * 3, "b": [0.5] * 3} and rounds.median("a") == 0.5
    assert rounds.outputs["a"] == 1.0 and torch.equal(rounds.outputs["b"], torch.ones(2))
    assert [r for r, _ in seen] == [0, 1, 2] and seen[0][1] == {"a": 0.5, "b": 0.5}


@pytest.mark.parametrize(("rounds", "warmup"), [(0, 1), (1, -1)])
def test_alternating_rounds_rejects_no_rounds_or_negative_warmup(rounds, warmup):
    with pytest.raises(ValueError, match="rounds >= 1 and warmup >= 0"):
        alternating_rounds({"a": lambda: None}, rounds, warmup=warmup)


@pytest.mark.parametrize("mode", bench.MODES)
def test_measure_rows(mode):
    rows = bench.measure(TINY, bench.Size(32, 1, 4, 4), mode, 1, model_kwargs={"depth": 2})
    assert [r["attention"] for r in rows] == ["timm", "mita m=4 k=4"]
    assert all(r["finite"] and r["images/s"] > 0 and r["N"] == 5 for r in rows)
    assert rows[0]["speed-up"] == 1.0 and rows[1]["speed-up"] == pytest.approx(
        rows[0]["seconds (median)"] / rows[1]["seconds (median)"]
    )
    assert (rows[0]["steps/s"] == "") == (mode == "infer")


def test_variants_share_weights_and_differ_in_attention():
    models = bench.variants(TINY, bench.Size(32, 1, 4, 4), {"depth": 2})
    base, converted = models["timm"].state_dict(), models["mita"].state_dict()
    assert base.keys() == converted.keys() and all(torch.equal(base[k], converted[k]) for k in base)
    assert type(models["timm"].blocks[0].attn).__name__ == "Attention"
    assert type(models["mita"].blocks[0].attn).__name__ == "MiTAVisionAttention"


def test_cli_writes_report_and_csv(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["vision", "bench", *FAST, "--sizes", "32:1:4", "64:2:4:8", "--out", str(out)]
    assert main(argv) == 0
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2  # sizes x modes x attentions
    assert {(r["px"], r["mode"], r["attention"]) for r in rows} >= {("64", "train", "mita m=4 k=8")}
    assert all(r["finite"] == "True" and float(r["images/s"]) > 0 and r["machine"] for r in rows)
    text = (out / "report.md").read_text()
    assert "| deit_tiny_patch16_224 | 32 | 5 | 1 | infer | timm |" in text and "Machine:" in text
    assert "--sizes 32:1:4 64:2:4:8" in text and "wrote" in capsys.readouterr().out
    # a non-empty --out is refused before any work, unless --force
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--force" in err
    assert main([*argv, "--modes", "infer", "--force"]) == 0


def test_cli_refuses_non_empty_out(tmp_path, capsys):
    (tmp_path / "old.txt").write_text("keep")
    assert main(["vision", "bench", *FAST, "--sizes", "32:1:4", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "not empty" in err and "--force" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--sizes", "40:1:4"], "not a multiple of"),
        (["--sizes", "32:1:5"], "perfect square"),
        (["--sizes", "32:0:4"], "batch"),
        (["--sizes", "32x1"], "PX:BATCH:M"),
        (["--rounds", "0"], "--rounds"),
        (["--threads", "0"], "--threads"),
        (["--models", "no_such_model"], "--models"),
    ],
)
def test_cli_errors_name_the_flag(flags, match, tmp_path, capsys):
    argv = ["vision", "bench", *FAST, "--sizes", "32:1:4", *flags, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and (flags[0] in err or "--sizes" in err)
    assert not (tmp_path / "out").exists()  # refused before the output folder is made
