"""Moving digits, the video ViT, the swap and robustness experiments on it, VideoMAE FLOPs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("timm")

from mita.layers.mita import MiTAAttention
from mita.models.convert import convert
from mita_experiments.cli import main
from mita_experiments.video import experiments as vx
from mita_experiments.video import moving_digits as md
from mita_experiments.video.model import VideoViT
from mita_experiments.vision import experiments
from mita_experiments.vision.digits import DigitsSetup

TINY = dict(epochs=1, batch_size=8, embed_dim=16, depth=1, num_heads=2)


@pytest.fixture(scope="module")
def clips() -> tuple[torch.Tensor, ...]:
    return md.load_moving_digits(seed=0, train_clips=24, test_clips=12)


def quiet(_: str) -> None:
    pass


def test_bounce_reflects_at_the_edges():
    path = md.bounce(torch.tensor([8.0]), torch.tensor([3.0]), 8, 10)
    assert path.tolist() == [[8, 9, 6, 3, 0, 3, 6, 9]]
    path = md.bounce(torch.tensor([1.0]), torch.tensor([-2.0]), 4, 10)
    assert path.tolist() == [[1, 1, 3, 5]]


def test_clips_are_seeded_and_labelled_by_the_fast_digit():
    images = torch.zeros(2, md.DIGIT, md.DIGIT)
    images[1] = 1.0  # digit "1" is a white square, digit "0" is invisible
    x, y = md.make_clips(16, images, torch.tensor([0, 1]), torch.Generator().manual_seed(0))
    assert x.shape == (16, md.FRAMES, 1, md.SIZE, md.SIZE) and x.min() >= 0 and x.max() <= 1
    for clip, label in zip(x, y):  # the white square moves by SLOW or FAST pixels a frame: its class is known
        rows = clip[:, 0].amax(-1).float().argmax(-1)  # first lit row of each frame
        cols = clip[:, 0].amax(-2).float().argmax(-1)
        step = ((rows[1] - rows[0]) ** 2 + (cols[1] - cols[0]) ** 2).float().sqrt()
        if label == 1:
            assert step >= md.FAST[0] - 1
        else:
            assert step <= md.SLOW[1] + 1
    again = md.make_clips(16, images, torch.tensor([0, 1]), torch.Generator().manual_seed(0))
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])


def test_load_moving_digits(clips):
    x_train, y_train, x_test, y_test = clips
    assert x_train.shape == (24, md.FRAMES, 1, md.SIZE, md.SIZE) and x_test.shape[0] == 12
    assert abs(float(x_train.mean())) < 1e-4 and y_train.max() <= 9 and y_test.min() >= 0


def test_video_vit_converts_to_mita_on_its_3d_grid():
    model = VideoViT(md.FRAMES, md.SIZE, 1, 10, vx.TUBELET, embed_dim=16, depth=2, num_heads=2)
    assert model.patch_embed.grid_size == vx.GRID == (4, 8, 8)
    clip = torch.randn(2, md.FRAMES, 1, md.SIZE, md.SIZE)
    assert model(clip).shape == (2, 10)
    convert(model, "mita:num_landmarks=8,topk=16")
    layers = experiments.mita_layers(model)
    assert len(layers) == 2 and all(layer.grid == (4, 8, 8) and layer.num_prefix_tokens == 0 for layer in layers)
    layers[0].record_routing = True
    model(clip)
    assert layers[0].routing.landmarks.shape == (2, 2, 8, 8)  # 2 x 2 x 2 landmarks
    with pytest.raises(ValueError, match="tubelet"):
        VideoViT(7, md.SIZE, 1, 10, vx.TUBELET)


def test_swap_on_moving_digits(tmp_path, clips):
    setup = DigitsSetup(**TINY)
    configs = ["sdpa", "mita:num_landmarks=8,topk=16", "agent:num_agents=8", "moba:block_size=32,topk=2"]
    rows = experiments.run_swap(tmp_path, setup, configs, "cmd", log=quiet, data=clips, task=vx.MOVING_DIGITS)
    assert [r["attention at test time"] for r in rows] == configs
    assert rows[0]["retained (%)"] == pytest.approx(100.0)
    report = (tmp_path / "report.md").read_text()
    assert "moving digits" in report and "N = 256" in report and (tmp_path / "swap.png").exists()


def test_swap_configs_fit_the_video_grid():
    configs = experiments.swap_configs(vx.VIDEO_OPTIONS, vx.SWAP_EXTRA)
    experiments.check_attentions(vx.MOVING_DIGITS, DigitsSetup(**TINY), configs, "--attention")  # each runs
    assert vx.VIDEO_OPTIONS["agent"] == {"num_agents": 8} and vx.VIDEO_OPTIONS["nystrom"] == {"num_landmarks": 32}


def test_robustness_on_moving_digits(tmp_path, clips):
    setup = DigitsSetup(attention="mita:num_landmarks=8,topk=8", **TINY)
    result = experiments.run_robustness(
        tmp_path, setup, (1, 8), (4, 256), "cmd", log=quiet, data=clips, task=vx.MOVING_DIGITS
    )
    assert result["grid"].shape == (2, 2) and (tmp_path / "robustness.png").exists()
    model = vx.make_video_vit(setup)
    assert all(isinstance(m, MiTAAttention) for m in experiments.mita_layers(model))
    with pytest.raises(ValueError, match="perfect cube"):
        experiments.run_robustness(tmp_path, setup, (4,), (8,), "cmd", log=quiet, data=clips, task=vx.MOVING_DIGITS)


def test_video_flops_row():
    from mita_experiments.video.flops import VideoBackbone, backbone_row

    row = backbone_row(VideoBackbone("narrow", 64, 1, 1), counted=False)  # 16 frames at 224 px, one head of 64
    assert row["N"] == 1568 and row["full GFLOPs"] > row["MiTA GFLOPs"] > 0
    assert row["reduction (%)"] == pytest.approx(100 * (1 - row["MiTA GFLOPs"] / row["full GFLOPs"]))
    tiny = backbone_row(VideoBackbone("tiny", 32, 1, 2, frames=4, image_size=32), counted=True)  # (2, 2, 2) grid
    assert tiny["N"] == 8 and tiny["MiTA GFLOPs (counted impl)"] > 0


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["swap", "--attention", "mita"],
            r"--attention mita: num_landmarks=\d+ with a 3-D grid must be a perfect cube",
        ),
        (["swap", "--attention", "sdpa", "mhla:num_blocks=16"], "--attention mhla:num_blocks=16: .*perfect cube"),
        (["robustness", "--m", "4"], "--m/--k give mita:num_landmarks=4,topk=4: .*perfect cube"),
    ],
    ids=["swap-mita-default", "swap-mhla", "robustness-m"],
)
def test_cli_refuses_options_off_the_grid_before_any_work(tmp_path, capsys, monkeypatch, argv, match):
    """Each attention is checked on the (4, 8, 8) grid before the clips are made or a model trained."""

    def nothing(*args, **kwargs):
        raise AssertionError("data made or a model trained before the attentions were checked")

    monkeypatch.setattr(experiments, "train", nothing)
    monkeypatch.setattr(vx, "MOVING_DIGITS", dataclasses.replace(vx.MOVING_DIGITS, load=nothing))
    assert main(["video", *argv, "--epochs", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err
