"""A small ViT on scikit-learn's handwritten digits: the offline testbed of the vision experiments.

The 1,797 8x8 digits (values 0-16) are upscaled bilinearly to 32x32 and cut into 4x4 patches:
an 8x8 grid of 64 patches plus a CLS token, N = 65. The split is seeded; training is the shared
trainer's (:mod:`mita_experiments.trainer`: seeded, a checkpoint every epoch, exact resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from mita import attention as registry

from .. import trainer
from ..utils.distributed import Dist

GRID = 8  # patches per side: 32 px images, 4 px patches


@dataclass(frozen=True)
class DigitsSetup:
    """What a digits run depends on; a run is resumed only for the same setup."""

    attention: str = "sdpa"
    epochs: int = 12
    batch_size: int = 32
    lr: float = 3e-3
    embed_dim: int = 64
    depth: int = 3
    num_heads: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "embed_dim", "depth", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        registry.resolve(self.attention)  # a clear error for an unknown method or bad config


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): (n, 1, 32, 32) images standardised with the training
    set's mean and std; a stratified, seeded split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    data = sk_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    images = F.interpolate(images, size=(4 * GRID, 4 * GRID), mode="bilinear", align_corners=False)
    labels = torch.tensor(data.target)
    idx_train, idx_test = train_test_split(
        range(len(labels)), test_size=test_fraction, random_state=seed, stratify=data.target
    )
    x_train, x_test = images[idx_train], images[idx_test]
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, labels[idx_train], (x_test - mean) / std, labels[idx_test]


#: makes the model of a setup
Build = Callable[[DigitsSetup], nn.Module]


def make_vit(setup: DigitsSetup) -> nn.Module:
    """A timm ViT for 1x32x32 digits (patch 4, CLS token, mean-pooled head) with ``setup.attention``."""
    from timm.models.vision_transformer import VisionTransformer

    from mita.models.convert import convert

    torch.manual_seed(setup.seed)
    model = VisionTransformer(
        img_size=4 * GRID,
        patch_size=4,
        in_chans=1,
        num_classes=10,
        embed_dim=setup.embed_dim,
        depth=setup.depth,
        num_heads=setup.num_heads,
        mlp_ratio=2.0,
        qkv_bias=True,
        global_pool="avg",
    )
    return convert(model, setup.attention) if setup.attention != "sdpa" else model


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> float:
    """Top-1 accuracy in [0, 1]."""
    model.eval()
    correct = sum(
        int((model(x[i : i + batch_size]).argmax(-1) == y[i : i + batch_size]).sum())
        for i in range(0, len(y), batch_size)
    )
    return correct / len(y)


class Tensors:
    """In-memory inputs (n, ...) and targets (n, ...) as a dataset of the trainer: ``__getitems__`` gives a
    whole batch, ``__getitem__`` one (input, target) pair."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"{len(x)} inputs but {len(y)} targets")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(indices)
        return self.x[idx], self.y[idx]


def scores(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> trainer.Scores:
    """Summed cross-entropy and number correct of a batch."""
    return trainer.classification_scores(model(batch[0]), batch[1])


def train_section(setup: DigitsSetup, examples: int, what: str = "training examples") -> dict[str, Any]:
    """The trainer's "train" section of ``setup`` on ``examples`` training examples (``what``, in the error):
    ``setup.epochs`` epochs of AdamW (weight decay 0.01) with a linear warm-up over the first tenth of the
    steps and a cosine decay, a log line and a checkpoint every epoch."""
    if setup.batch_size > examples:
        raise ValueError(f"--batch-size {setup.batch_size} exceeds the {examples} {what}")
    steps_per_epoch = examples // setup.batch_size
    steps = setup.epochs * steps_per_epoch
    return {
        "batch_size": setup.batch_size,
        "steps": steps,
        "lr": setup.lr,
        "weight_decay": 0.01,
        "schedule": "cosine",
        "warmup": steps // 10,
        "seed": setup.seed,
        "log_every": steps_per_epoch,
        "checkpoint_every": steps_per_epoch,
    }


def training(
    setup: DigitsSetup, data: tuple[torch.Tensor, ...], build: Build = make_vit, name: str = "digits"
) -> tuple[trainer.Task, dict[str, Any]]:
    """The trainer's task and config of a digits run: ``build(setup)``'s model on ``data``'s training
    split, trained as :func:`train_section` says. ``name`` names the task."""
    x_train, y_train = data[0], data[1]
    train = train_section(setup, len(y_train))
    task = trainer.Task(
        build_model=lambda: build(setup),
        scores=scores,
        train_data=Tensors(x_train, y_train),
        identity={"task": name, "attention": setup.attention},
        fingerprint={"train": trainer.tensor_digest(x_train, y_train)},
        name=f"{name} {setup.attention}",
    )
    return task, {"train": train, "task": name, "setup": asdict(setup)}


def train(
    setup: DigitsSetup,
    data: tuple[torch.Tensor, ...],
    run_dir: str | Path,
    *,
    force: bool = False,
    build: Build = make_vit,
    name: str = "digits",
    progress: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train a digits ViT (or ``build(setup)``'s model) in the run folder ``run_dir`` (:func:`training`,
    on the CPU), resuming the run there if it was interrupted.

    A run of another setup or task there is an error, or is started over with ``force``.
    Returns the trained model and a summary: its test accuracy and its training seconds.
    """
    task, config = training(setup, data, build, name)
    model, seconds = fit(task, config, setup, run_dir, name=name, build=build, force=force, progress=progress)
    return model, {"test_accuracy": evaluate(model, data[2], data[3]), "train_seconds": seconds}


def fit(
    task: trainer.Task,
    config: dict[str, Any],
    setup: DigitsSetup,
    run_dir: str | Path,
    *,
    name: str,
    build: Callable[[Any], nn.Module],
    force: bool = False,
    progress: bool = True,
) -> tuple[nn.Module, float]:
    """Train ``task`` with ``config`` in the run folder ``run_dir`` on the CPU, resuming the run there if it
    was interrupted; then ``build(setup)`` with the final weights.

    Args:
        task (trainer.Task): what is trained.
        config (dict): the trainer's config, with ``"task": name`` and ``"setup": asdict(setup)``.
        setup (DigitsSetup): the run's setup (a run of another setup there is an error unless ``force``).
        run_dir (str | Path): the run folder.
        name (str): the task's name, as recorded in the run.
        build (callable): setup -> the model, to load the final weights into.
        force (bool): start over in a run folder of another run. Default False.
        progress (bool): show a progress bar. Default True.

    Returns:
        The trained model and its training seconds.
    """
    run_dir = Path(run_dir)
    if not force and (run_dir / trainer.MANIFEST).is_file():
        run = trainer.read_manifest(run_dir)["config"]
        if (run.get("task"), run.get("setup")) != (name, asdict(setup)):
            raise ValueError(
                f"{run_dir} holds a {run.get('task')} run of {run.get('setup')}, not of {asdict(setup)}; "
                "use another output folder or --force to train over it"
            )
    summary = trainer.train(
        task,
        config,
        run_dir,
        resume=not force and (run_dir / trainer.CHECKPOINT).is_file(),
        force=force,
        progress=progress,
        tensorboard=False,
        ctx=Dist(),
    )
    model = build(setup)
    weights = run_dir / trainer.WEIGHTS
    trainer.load_model_state(model, trainer.read_checkpoint(weights)["model"], weights)
    return model, summary["train_seconds"]
