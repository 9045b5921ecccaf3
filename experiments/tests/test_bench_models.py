"""``mita bench vit|video|lra``: whole models timed side by side, and ``mita bench`` as the one timing verb."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
import torch

from mita_experiments.benchmarks import timing, vit
from mita_experiments.benchmarks.models import side_by_side, timed_rows, write_results
from mita_experiments.benchmarks.timing import alternating_rounds
from mita_experiments.cli import build_parser, main

TINY = "deit_tiny_patch16_224"
FAST = ["bench", "vit", "--models", TINY, "--model-args", "depth=2", "--rounds", "1", "--threads", "1"]
LRA = ["bench", "lra", "--task", "listops", "--set", "model.dim=16", "--set", "model.mlp_dim=16"]
LRA += ["--set", "model.head_dim=8", "--batch", "2", "--steps", "1", "--threads", "1"]


def rows_of(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_bench_is_the_one_timing_verb(capsys):
    """``mita bench`` times the ops when no target is named; the old timing verbs are gone."""
    parse = build_parser().parse_args
    assert parse(["bench"]).target == "op"
    args = parse(["bench", "--methods", "mita", "sdpa", "--rounds", "3"])
    assert (args.target, args.methods, args.rounds) == ("op", ["mita", "sdpa"], 3)
    assert args.bench_argv == ["op", "--methods", "mita", "sdpa", "--rounds", "3"]
    assert [parse(["bench", t]).target for t in ("op", "video")] == ["op", "video"]
    assert parse(["bench", "lra", "--task", "listops", "--lengths", "8"]).target == "lra"
    for old in (["vision", "bench"], ["video", "bench"], ["lra", "speed", "--task", "listops", "--lengths", "8"]):
        with pytest.raises(SystemExit):
            parse(old)
        assert "invalid choice" in capsys.readouterr().err


def test_alternating_rounds_times_each_call_once_per_round_in_turn(monkeypatch):
    clock = itertools.count(0.0, 0.5)  # every perf_counter read is 0.5 s after the previous one
    monkeypatch.setattr("mita_experiments.benchmarks.timing.time.perf_counter", lambda: next(clock))
    faults = itertools.count(0, 3)  # every fault-count read is 3 faults after the previous one
    monkeypatch.setattr("mita_experiments.benchmarks.timing.minor_faults", lambda: next(faults))
    order: list[str] = []
    seen: list[tuple[int, dict[str, float]]] = []
    calls = {"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or torch.ones(2)}
    rounds = alternating_rounds(calls, 3, warmup=2, on_round=lambda r, s: seen.append((r, s)))
    assert order == ["a", "b"] * 5  # two warm-up calls each, then three alternating rounds
    assert rounds.times == {"a": [0.5] * 3, "b": [0.5] * 3} and rounds.median("a") == 0.5
    assert rounds.faults == {"a": [3] * 3, "b": [3] * 3} and rounds.median_faults("b") == 3
    assert rounds.outputs["a"] == 1.0 and torch.equal(rounds.outputs["b"], torch.ones(2))
    assert [r for r, _ in seen] == [0, 1, 2] and seen[0][1] == {"a": 0.5, "b": 0.5}


def test_page_faults_are_blank_where_the_os_does_not_count_them(monkeypatch, tmp_path):
    monkeypatch.setattr("mita_experiments.benchmarks.timing.minor_faults", lambda: None)
    rounds = alternating_rounds({"a": lambda: torch.ones(1)}, 2)
    assert rounds.faults == {"a": []} and rounds.median_faults("a") is None
    timed = side_by_side({"a": lambda: torch.ones(1)}, 2, "a")
    rows = timed_rows(timed, {"model": "m"}, 1, "images", 2)
    assert rows[0]["page faults/call"] is None
    report = write_results(tmp_path, rows, "t", "how.", "cmd").read_text()
    assert "| m | a |" in report and "page faults/call: the process's minor page faults" in report
    assert rows_of(tmp_path)[0]["page faults/call"] == ""


def test_page_faults_are_counted_on_posix():
    if timing.resource is None:
        pytest.skip("no getrusage on this OS")
    before = timing.minor_faults()
    fresh = bytearray(64 << 20)  # 64 MiB, mapped anew: reading a page of it faults
    assert fresh[-1] == 0 and timing.minor_faults() > before


@pytest.mark.parametrize(("rounds", "warmup"), [(0, 1), (1, -1)])
def test_alternating_rounds_rejects_no_rounds_or_negative_warmup(rounds, warmup):
    with pytest.raises(ValueError, match="rounds >= 1 and warmup >= 0"):
        alternating_rounds({"a": lambda: None}, rounds, warmup=warmup)


# --- vit -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", vit.MODES)
def test_vit_measure_rows(mode):
    pytest.importorskip("timm")
    rows = vit.measure(TINY, vit.Size(32, 1, 4, 4), mode, 1, model_kwargs={"depth": 2})
    assert [r["attention"] for r in rows] == ["timm", "mita m=4 k=4"]
    assert all(r["finite"] and r["images/s"] > 0 and r["N"] == 5 for r in rows)
    assert all(r["page faults/call"] >= 0 for r in rows) or timing.resource is None
    assert rows[0]["speed-up"] == 1.0 and rows[1]["speed-up"] == pytest.approx(
        rows[0]["seconds (median)"] / rows[1]["seconds (median)"]
    )
    assert (rows[0]["steps/s"] == "") == (mode == "infer")


def test_vit_bfloat16_runs_both_models_under_autocast(monkeypatch):
    """--dtype bfloat16: the attention inputs reach MiTA's op in bfloat16 (CPU autocast), rows say so."""
    pytest.importorskip("timm")
    import mita.layers.mita as layer

    seen = []
    real = layer.mita_attention
    monkeypatch.setattr(layer, "mita_attention", lambda q, *a, **k: seen.append(q.dtype) or real(q, *a, **k))
    rows = vit.measure(TINY, vit.Size(32, 1, 4, 4), "infer", 1, model_kwargs={"depth": 2}, dtype="bfloat16")
    assert all(r["dtype"] == "bfloat16" and r["finite"] for r in rows)
    assert seen and set(seen) == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype must be one of"):
        vit.measure(TINY, vit.Size(32, 1, 4, 4), "infer", 1, model_kwargs={"depth": 2}, dtype="float16")


def test_vit_variants_share_weights_and_differ_in_attention():
    pytest.importorskip("timm")
    models = vit.variants(TINY, vit.Size(32, 1, 4, 4), {"depth": 2})
    base, converted = models["timm"].state_dict(), models["mita"].state_dict()
    assert base.keys() == converted.keys() and all(torch.equal(base[k], converted[k]) for k in base)
    assert type(models["timm"].blocks[0].attn).__name__ == "Attention"
    assert type(models["mita"].blocks[0].attn).__name__ == "MiTAVisionAttention"


def test_vit_writes_results_and_refuses_a_non_empty_out(tmp_path, capsys):
    pytest.importorskip("timm")
    out = tmp_path / "bench"
    argv = [*FAST, "--sizes", "32:1:4", "64:2:4:8", "--out", str(out)]
    assert main(argv) == 0
    rows = rows_of(out)
    assert len(rows) == 2 * 2 * 2  # sizes x modes x attentions
    assert {(r["px"], r["mode"], r["attention"]) for r in rows} >= {("64", "train", "mita m=4 k=8")}
    assert all(r["finite"] == "True" and float(r["images/s"]) > 0 and r["machine"] for r in rows)
    text = (out / "results.md").read_text()
    assert "| deit_tiny_patch16_224 | 32 | 5 | 1 | infer | float32 | timm |" in text and "Machine:" in text
    assert f"Command: `mita bench vit --models {TINY}" in text and "--sizes 32:1:4 64:2:4:8" in text
    assert "results in" in capsys.readouterr().out
    assert main(argv) == 2  # a non-empty --out is refused before any work, unless --force
    err = capsys.readouterr().err
    assert "--out" in err and "--force" in err
    assert main([*argv, "--modes", "infer", "--force"]) == 0
    assert len(rows_of(out)) == 2 * 2


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
def test_vit_errors_name_the_flag(flags, match, tmp_path, capsys):
    pytest.importorskip("timm")
    assert main([*FAST, "--sizes", "32:1:4", *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert match in err and (flags[0] in err or "--sizes" in err)
    assert not (tmp_path / "out").exists()  # refused before the output folder is made


# --- video ---------------------------------------------------------------------------------


def test_videomae_clip_throughput_rows():
    pytest.importorskip("transformers")
    from mita_experiments.benchmarks.video import clip_throughput
    from mita_experiments.video.flops import VideoBackbone

    rows = clip_throughput(VideoBackbone("tiny", 64, 1, 2, frames=4, image_size=64), rounds=1)
    assert [r["attention"] for r in rows] == ["sdpa", "mita m=(2, 4, 4) k=98"]
    assert all(r["finite"] and r["clips/s"] > 0 for r in rows) and rows[0]["speed-up"] == 1.0


def test_video_writes_results(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "video"
    assert main(["bench", "video", "--frames", "4", "--layers", "1", "--rounds", "1", "--out", str(out)]) == 0
    rows = rows_of(out)
    assert [(r["N"], r["attention"]) for r in rows] == [("392", "sdpa"), ("392", "mita m=(2, 7, 7) k=98")]
    assert "a 1-layer VideoMAE-B forward" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("flags", "match"),
    [(["--frames", "3"], "--frames"), (["--rounds", "0"], "--rounds"), (["--batch", "0"], "--batch")],
)
def test_video_errors_name_the_flag(flags, match, tmp_path, capsys):
    assert main(["bench", "video", *flags, "--out", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- lra -----------------------------------------------------------------------------------


def test_lra_times_each_attention_mode_and_length(tmp_path):
    out = tmp_path / "lra"
    argv = [*LRA, "--methods", "sdpa", "mita:num_landmarks=4,topk=4", "--lengths", "8", "16"]
    assert main([*argv, "--modes", "train", "infer", "--out", str(out)]) == 0
    rows = rows_of(out)
    assert [(r["attention"], r["mode"], r["length"]) for r in rows] == [
        (a, mode, n)
        for a in ("sdpa", "mita:num_landmarks=4,topk=4")
        for mode in ("train", "infer")
        for n in ("8", "16")
    ]
    assert all(r["task"] == "listops" and float(r["seconds_per_step"]) > 0 and r["machine"] for r in rows)
    assert "Command: `mita bench lra --task listops" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--lengths", "0"], "--lengths"),
        (["--lengths", "8", "--steps", "0"], "--steps"),
        (["--lengths", "8", "--warmup", "-1"], "--warmup"),
        (["--lengths", "8", "--methods", "nope"], "nope"),
        (["--lengths", "8", "--set", "model.nope=1"], "nope"),
        (["--lengths", "8", "--device", "tpu"], "--device"),
    ],
)
def test_lra_errors_name_the_flag(flags, match, tmp_path, capsys):
    assert main([*LRA, *flags, "--out", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
