"""A small ViT on scikit-learn's handwritten digits: the offline testbed of the vision experiments.

The 1,797 8x8 digits (values 0-16) are upscaled bilinearly to 32x32 and cut into 4x4 patches:
an 8x8 grid of 64 patches plus a CLS token, N = 65. The split, the initialisation and the
batch order are seeded. Training checkpoints every epoch and resumes from the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from mita import attention as registry

from ..utils.checkpoint import load_checkpoint, save_checkpoint

GRID = 8  # patches per side: 32 px images, 4 px patches


@dataclass(frozen=True)
class DigitsSetup:
    """What a digits run depends on; a checkpoint is reused only for the same setup."""

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


def _matching_checkpoint(checkpoint: Path | None, setup: DigitsSetup, restart: bool) -> dict[str, Any] | None:
    """The checkpoint's state if it exists and was made with ``setup``; a mismatch is an error unless ``restart``."""
    if checkpoint is None or not checkpoint.exists():
        return None
    state = load_checkpoint(checkpoint)
    if state.get("setup") == asdict(setup):
        return state
    if restart:
        return None
    raise ValueError(
        f"checkpoint {checkpoint} was made with {state.get('setup')}, not {asdict(setup)}; "
        "use another output folder or --force to train over it"
    )


def train(
    setup: DigitsSetup,
    data: tuple[torch.Tensor, ...],
    checkpoint: Path | None = None,
    restart: bool = False,
    log=print,
    build: Callable[[DigitsSetup], nn.Module] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train a digits ViT (or ``build(setup)``'s model); with ``checkpoint``, save after every epoch and resume from it.

    A checkpoint of another setup is an error, or is trained over with ``restart=True``.
    Returns the model and a summary (test accuracy, training seconds over all sessions).
    """
    x_train, y_train, x_test, y_test = data
    model = (build or make_vit)(setup)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.01)
    steps_per_epoch = -(-len(y_train) // setup.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, setup.lr, total_steps=setup.epochs * steps_per_epoch, pct_start=0.1
    )
    start, seconds = 0, 0.0
    state = _matching_checkpoint(checkpoint, setup, restart)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start, seconds = state["epoch"], state["seconds"]
        log(f"resumed {setup.attention} from {checkpoint} at epoch {start}")
    generator = torch.Generator().manual_seed(setup.seed)
    for _ in range(start):  # replay the RNG so a resumed run sees the same batches
        torch.randperm(len(y_train), generator=generator)
    for epoch in range(start, setup.epochs):
        t0 = time.perf_counter()
        model.train()
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for i in range(0, len(order), setup.batch_size):
            batch = order[i : i + setup.batch_size]
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(batch)
        seconds += time.perf_counter() - t0
        if checkpoint is not None:
            state = {
                "setup": asdict(setup),
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "epoch": epoch + 1,
                "seconds": seconds,
            }
            save_checkpoint(state, checkpoint)
        log(f"{setup.attention} epoch {epoch + 1}/{setup.epochs}: loss {total / len(order):.4f}")
    return model, {"test_accuracy": evaluate(model, x_test, y_test), "train_seconds": seconds}
