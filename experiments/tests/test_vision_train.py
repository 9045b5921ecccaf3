"""The ImageNet recipe end to end on a tiny ImageFolder the test writes (32x32 images, a few steps)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("torchvision")
Image = pytest.importorskip("PIL.Image")

from mita_experiments.cli import main  # noqa: E402

MODEL = ["--model", "mita_deit_tiny_patch16_224_dwc_gate", "--model-args", "depth=1,num_landmarks=4,topk=4"]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """train/ and val/ with 2 classes of 4 and 2 random 32x32 RGB images."""
    root = tmp_path_factory.mktemp("imagenet")
    gen = torch.Generator().manual_seed(0)
    for split, count in (("train", 4), ("val", 2)):
        for label in ("cat", "dog"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = torch.randint(0, 256, (32, 32, 3), generator=gen, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / label / f"{i}.png")
    return root


def args(data, out, *extra: str) -> list[str]:
    common = ["--img-size", "32", "--batch-size", "2", "--workers", "0", "--warmup-epochs", "0"]
    return ["vision", "train", "--data", str(data), "--out", str(out), *MODEL, *common, *extra]


def test_train_resume_and_refuse(image_folder, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args(image_folder, out, "--epochs", "1")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epoch"] == 1 and summary["steps"] == 4 and 0 <= summary["val_top1"] <= 100
    state = torch.load(out / "checkpoint.pth", weights_only=True)
    assert "blocks.0.attn.out_gate.weight" in state["model"]
    assert main(args(image_folder, out, "--epochs", "2")) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(args(image_folder, out, "--epochs", "2", "--resume")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epoch"] == 2 and summary["steps"] == 8
    assert len((out / "log.jsonl").read_text().splitlines()) == 2


def test_max_steps_without_mixup(image_folder, tmp_path):
    out = tmp_path / "run"
    extra = ("--epochs", "3", "--max-steps", "1", "--mixup", "0", "--cutmix", "0", "--aa", "")
    assert main(args(image_folder, out, *extra)) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": "missing"}, "ImageFolder tree"),
        ({"extra": ("--batch-size", "3")}, "even --batch-size"),
        ({"extra": ("--epochs", "0")}, "--epochs must be"),
        ({"extra": ("--lr", "0")}, "--lr must be"),
        ({"extra": ("--resume",)}, "no checkpoint"),
    ],
    ids=["no-data", "odd-batch", "epochs", "lr", "resume-nothing"],
)
def test_errors(image_folder, tmp_path, capsys, change, message):
    data = tmp_path / change["data"] if "data" in change else image_folder
    assert main(args(data, tmp_path / "run", *change.get("extra", ()))) == 2
    assert message in capsys.readouterr().err


def test_train_transform_posterizes_to_zero_bits():
    """At magnitude 10 an ``inc1`` policy keeps 0 bits: a black image, not Pillow 13's ValueError."""
    from mita_experiments.vision.train import train_transform

    transform = train_transform({"input_size": (3, 32, 32)}, "rand-m10-inc1", 0.0)
    (posterize,) = [
        op for step in transform.transforms for op in getattr(step, "ops", ()) if op.name == "PosterizeIncreasing"
    ]
    posterize.prob = 1.0
    image = Image.fromarray(torch.full((8, 8, 3), 200, dtype=torch.uint8).numpy())
    assert posterize(image).getextrema() == ((0, 0),) * 3
