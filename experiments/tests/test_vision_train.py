"""The ImageNet recipe on the shared trainer, end to end on a tiny ImageFolder the test writes (32x32 images)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("torchvision")
Image = pytest.importorskip("PIL.Image")

from mita_experiments.cli import main  # noqa: E402
from mita_experiments.trainer import read_checkpoint  # noqa: E402

MODEL = ["--model", "mita_deit_tiny_patch16_224_dwc_gate", "--model-args", "depth=1,num_landmarks=4,topk=4"]
QUIET = ["--no-progress", "--no-tensorboard", "--device", "cpu"]


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
    """A run of 2 epochs of 4 steps (8 images, 2 a step), every augmentation of the recipe on."""
    common = ["--img-size", "32", "--batch-size", "2", "--workers", "0", "--warmup-epochs", "1", "--epochs", "2"]
    return ["vision", "train", "--data", str(data), "--out", str(out), *MODEL, *common, *QUIET, *extra]


def weights(run) -> dict[str, torch.Tensor]:
    return read_checkpoint(run / "model.safetensors")["model"]


def test_train_writes_the_run_folder(image_folder, tmp_path):
    out = tmp_path / "run"
    assert main(args(image_folder, out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == summary["steps"] == 8 and summary["finished"] and 0 <= summary["best_val_top1"] <= 1
    assert summary["model"] == "mita_deit_tiny_patch16_224_dwc_gate"
    assert "blocks.0.attn.out_gate.weight" in weights(out)
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["train"]["lr"] == pytest.approx(5e-4 * 2 / 512)  # DeiT's linear scaling rule
    assert config["train"]["warmup"] == 4 and config["train"]["eval_every"] == 4  # epochs in steps
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "val"] == [4, 8]  # evaluated every epoch


def test_resume_is_exact(image_folder, tmp_path):
    """Issue 25 item 9: an interrupted run, resumed, ends with the weights of an uninterrupted one
    (the RNG and data-order state are in the checkpoint; augmentations, Mixup and drop path are random)."""
    assert main(args(image_folder, tmp_path / "straight", "--drop-path", "0.5")) == 0
    cut = tmp_path / "cut"
    assert main(args(image_folder, cut, "--drop-path", "0.5", "--stop-after", "3")) == 0  # mid-epoch
    assert json.loads((cut / "summary.json").read_text())["step"] == 3
    resume = ["vision", "train", "--data", str(image_folder), "--out", str(cut), "--workers", "0", *QUIET]
    assert main([*resume, "--resume"]) == 0  # the recipe left out: the run's
    straight, resumed = weights(tmp_path / "straight"), weights(cut)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_resume_refuses_another_model_or_lr(image_folder, tmp_path, capsys):
    """Issue 25 item 9: --resume with another --model or --lr than the run's is refused, naming them."""
    out = tmp_path / "run"
    assert main(args(image_folder, out, "--stop-after", "1")) == 0
    before = (out / "checkpoint.pt").read_bytes()
    assert main(args(image_folder, out, "--resume", "--lr", "1e-3")) == 2
    err = capsys.readouterr().err
    assert "--lr 0.0005" in err and "--lr 0.001" in err and "--model" not in err
    other = args(image_folder, out, "--resume")
    other[other.index("--model") + 1] = "deit_tiny_patch16_224"
    assert main(other) == 2
    assert "--model" in capsys.readouterr().err
    assert (out / "checkpoint.pt").read_bytes() == before  # nothing trained or written
    assert main(args(image_folder, out, "--resume", "--epochs", "3")) == 0  # more epochs may be given
    assert json.loads((out / "summary.json").read_text())["step"] == 12


def test_force_starts_a_clean_run_folder(image_folder, tmp_path, capsys):
    """Issue 25 item 9: --force starts over; the old run's log is not appended to."""
    out = tmp_path / "run"
    assert main(args(image_folder, out)) == 0
    log = (out / "metrics.jsonl").read_text()
    assert main(args(image_folder, out)) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--force" in err
    assert main(args(image_folder, out, "--force")) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == len(log.splitlines())


def test_clip_grad_is_refused_where_the_configuration_is_made(image_folder, tmp_path, capsys):
    """Issue 25 item 9: a negative --clip-grad is refused before any data is read or file written."""
    out = tmp_path / "run"
    assert main(args(tmp_path / "no-data", out, "--clip-grad", "-1")) == 2
    assert "--clip-grad must be a gradient norm >= 0" in capsys.readouterr().err
    assert not out.exists()


def test_amp_and_no_mixup(image_folder, tmp_path):
    extra = ("--amp", "--mixup", "0", "--cutmix", "0", "--aa", "", "--batch-size", "3", "--stop-after", "1")
    assert main(args(image_folder, tmp_path / "run", *extra)) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["config"]["train"]["precision"] == "bf16"


def test_torchrun_two_processes_with_amp(image_folder, tmp_path):
    """The one torchrun entry: ``torchrun -m mita_experiments vision train`` (DDP over gloo, bf16
    autocast, a loading process per rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    launch += ["--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "mita_experiments"]
    train = args(image_folder, out, "--amp")  # one epoch of 2 steps, its evaluation, best.pt read by both ranks
    train[train.index("--workers") + 1] = "1"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, *train], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 4 and summary["finished"]  # 8 images, 2 processes x 2 a step, 2 epochs
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows if r["split"] == "val"] == [(2, "val"), (4, "val")]
    assert (out / "model.safetensors").exists()
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["world_size"] == 2 and state["config"]["train"]["precision"] == "bf16"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": "missing"}, "ImageFolder tree"),
        ({"extra": ("--batch-size", "3")}, "--batch-size must be even"),
        ({"extra": ("--batch-size", "10", "--mixup", "0", "--cutmix", "0")}, "exceeds the 8 training images"),
        ({"extra": ("--epochs", "0")}, "--epochs must be"),
        ({"extra": ("--lr", "0")}, "--lr must be"),
        ({"extra": ("--drop-path", "1")}, "--drop-path must be"),
        ({"extra": ("--smoothing", "nan")}, "--smoothing must be"),
        ({"extra": ("--model", "no_such_model")}, "--model 'no_such_model'"),
        ({"extra": ("--model-args", "no_such_option=1")}, "--model-args"),
        ({"extra": ("--workers", "-1")}, "--workers"),
        ({"extra": ("--resume", "--force")}, "give one of them"),
    ],
    ids=[
        "no-data",
        "odd-batch",
        "batch-too-large",
        "epochs",
        "lr",
        "drop-path",
        "smoothing",
        "model",
        "model-args",
        "workers",
        "resume-and-force",
    ],
)
def test_errors(image_folder, tmp_path, capsys, change, message):
    data = tmp_path / change["data"] if "data" in change else image_folder
    assert main(args(data, tmp_path / "run", *change.get("extra", ()))) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


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
