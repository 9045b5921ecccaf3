"""Semantic segmentation runs (mita_experiments.segmentation): the offline scenes experiment, the FLOP table,
``mita bench seg``, ``mita seg train`` (resume, periodic evaluation, miou.json) and ``mita seg eval`` (the swap, a
checkpoint of the Segmenter code), on small ADE20K files written in the real format."""

from __future__ import annotations

import csv
import json

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("PIL")

from mita_experiments.cli import main
from mita_experiments.segmentation import flops
from mita_experiments.segmentation.scenes import load_scenes
from mita_experiments.segmentation.task import ScenesSetup
from test_segmentation import write_ade20k


def test_scenes_experiment(tmp_path):
    from mita_experiments.segmentation.experiments import run_scenes

    data = load_scenes(0, train=32, test=8)
    setup = ScenesSetup(epochs=1, batch_size=16, embed_dim=32, depth=1, num_heads=2)
    result = run_scenes(
        tmp_path, setup, "test", configs=["sdpa", "mita:num_landmarks=4,topk=8"], ms=(4,), ks=(8, 145), data=data
    )
    names = {p.name for p in tmp_path.iterdir()}
    assert {"report.md", "runs.csv", "swap.csv", "robustness.csv", "swap.png", "robustness.png"} <= names
    with open(tmp_path / "swap.csv") as f:
        swap = list(csv.DictReader(f))
    assert [r["attention at test time"] for r in swap][-1].endswith("(decoder too)")
    assert float(swap[0]["mIoU kept (%)"]) == pytest.approx(100.0)  # sdpa on the sdpa model
    assert {"date", "machine"} <= set(swap[0])
    assert result["robustness"].shape == (1, 2)
    # a re-run resumes the finished runs instead of training again
    again = run_scenes(tmp_path, setup, "test", configs=["sdpa"], ms=(4,), ks=(8,), data=data)
    assert again["runs"][0]["test mIoU (%)"] == result["runs"][0]["test mIoU (%)"]
    with pytest.raises(ValueError, match="perfect squares"):
        run_scenes(tmp_path, setup, "test", ms=(5,), data=data)


# --- FLOPs and speed ------------------------------------------------------------------------


def test_flops_row():
    row = flops.segmenter_row(flops.SegmenterSize("Seg-T/16 at 256", "tiny", image=256), counted=True)
    assert row["N (enc / dec)"] == "257 / 406"
    assert 0 < row["reduction enc (%)"] < row["reduction enc+dec (%)"] < row["attention share (%)"]
    assert abs(row["reduction enc+dec, counted impl (%)"] - row["reduction enc+dec (%)"]) < 5
    assert row["params (M)"] == pytest.approx(6.7, abs=0.2)


def test_bench_seg(tmp_path):
    from mita_experiments.segmentation.bench import measure

    rows = measure("tiny", 32, 1, rounds=1, m=4, k=4, depth=1)
    assert [r["attention"] for r in rows] == ["sdpa", "mita enc", "mita enc+dec"]
    assert all(r["finite"] and r["images/s"] > 0 for r in rows)
    assert main(["bench", "seg", "--image", "30", "--out", str(tmp_path / "b")]) == 2


# --- mita seg train | eval ------------------------------------------------------------------


def test_train_resume_and_eval(tmp_path, capsys):
    from mita.models.segmenter import DEFAULT_ATTENTION
    from mita_experiments.segmentation.train import RECIPE

    assert RECIPE["attention"] == DEFAULT_ATTENTION
    top = write_ade20k(tmp_path / "data")
    run = tmp_path / "run"
    args = ["seg", "train", "--data", str(top), "--out", str(run), "--crop", "32", "--batch-size", "1"]
    args += ["--epochs", "1", "--attention", "mita:num_landmarks=4,topk=4", "--decoder-depth", "1"]
    args += ["--window", "32", "--stride", "16", "--workers", "0", "--no-progress", "--no-tensorboard"]
    assert main([*args, "--stop-after", "2"]) == 0
    assert not (run / "miou.json").exists()
    assert (
        main(["seg", "train", "--data", str(top), "--out", str(run), "--resume", "--no-progress", "--workers", "0"])
        == 0
    )
    result = json.loads((run / "miou.json").read_text())
    assert 0 <= result["mIoU"] <= 1 and len(result["iou"]) == 150 and result["images"] == 2
    assert {"model.safetensors", "best.pt", "metrics.csv"} <= {p.name for p in run.iterdir()}
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r["split"] == "val" for r in rows)
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["seg", "eval", "--data", str(top), "--checkpoint", str(run / "model.safetensors"),
                 "--attention", "sdpa", "--out", str(out)]) == 0  # fmt: skip
    swapped = json.loads(out.read_text())
    assert swapped["attention"] == "sdpa" and swapped["window"] == 32 and swapped["images"] == 2
    assert main(["seg", "eval", "--data", str(top)]) == 2
    assert "one of --checkpoint" in capsys.readouterr().err
    assert main([*args, "--force", "--size", "huge"]) == 2


def test_segmenter_checkpoint_eval(tmp_path):
    """A checkpoint in the Segmenter code's layout ({"model": ...}, encoder head included) evaluates."""
    from mita.models.segmenter import create_segmenter

    top = write_ade20k(tmp_path / "data")
    model = create_segmenter("tiny", img_size=512, attention="sdpa", decoder_depth=1)
    state = dict(model.state_dict())
    state["encoder.head.weight"], state["encoder.head.bias"] = torch.zeros(1000, 192), torch.zeros(1000)
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": state, "epoch": 63}, path)
    out = tmp_path / "eval.json"
    argv = ["seg", "eval", "--data", str(top), "--segmenter-checkpoint", str(path), "--decoder-depth", "1"]
    assert main([*argv, "--attention", "sdpa", "--limit", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["images"] == 1


def test_encoder_init_from_timm_weights(tmp_path):
    """``--init``: timm ViT weights (head dropped, 14x14 position embeddings resampled to 4x4) into the encoder."""
    from safetensors.torch import save_file
    from timm.models.vision_transformer import VisionTransformer

    from mita.models.segmenter import create_segmenter
    from mita_experiments.segmentation.train import load_encoder

    vit = VisionTransformer(embed_dim=48, depth=1, num_heads=2, qkv_bias=True)
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, tmp_path / "vit.safetensors")
    model = create_segmenter("tiny", img_size=64, embed_dim=48, depth=1, num_heads=2, attention="sdpa")
    load_encoder(model, tmp_path / "vit.safetensors")
    assert torch.equal(model.encoder.blocks[0].attn.qkv.weight, vit.blocks[0].attn.qkv.weight)
    assert model.encoder.pos_embed.shape == (1, 17, 48)
    torch.save({"model": {"blocks.0.attn.qkv.weight": torch.zeros(1)}}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="missing keys"):
        load_encoder(model, tmp_path / "bad.pth")
