"""Segmenter on the shared trainer: the loss and pixel accuracy of a batch, mIoU over a data set, and the
generated-scenes runs of the offline experiments.

The trainer sums per-pixel cross-entropy and right pixels over the labelled pixels (``Scores``),
so its logs and ``best.pt`` selection use pixel accuracy; mIoU is not a sum of per-batch numbers
and is computed by :func:`evaluate_miou` from the confusion matrix of a whole split.
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
from ..vision.digits import DigitsSetup, Tensors, fit, train_section
from .metrics import IGNORE_INDEX, ConfusionMatrix
from .scenes import NUM_CLASSES, SIZE, load_scenes

__all__ = [
    "ScenesSetup",
    "SegmentationScores",
    "evaluate_miou",
    "make_scenes_model",
    "train_scenes",
]


def predict(
    model: nn.Module, images: torch.Tensor, size: tuple[int, int], window: int | None, stride: int | None
) -> torch.Tensor:
    """Logits (B, K, *size) of ``images``: a sliding window of ``window`` px every ``stride`` px (None: the
    whole image), resized bilinearly to the labels' ``size``."""
    logits = model(images) if window is None else model.slide(images, window, stride)
    if tuple(logits.shape[-2:]) != tuple(size):
        logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
    return logits


@dataclass(frozen=True)
class SegmentationScores:
    """The trainer's ``scores``: summed per-pixel cross-entropy and right pixels ("accuracy") over the
    labelled pixels of a batch (images, targets). In evaluation the logits come from :func:`predict`
    (``window``, ``stride``: the sliding window, None for the whole image)."""

    window: int | None = None
    stride: int | None = None

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> trainer.Scores:
        images, labels = batch
        if model.training:
            logits = model(images)
        else:
            logits = predict(model, images, tuple(labels.shape[-2:]), self.window, self.stride)
        return trainer.classification_scores(logits.permute(0, 2, 3, 1), labels, ignore_index=IGNORE_INDEX)


@torch.no_grad()
def evaluate_miou(
    model: nn.Module,
    dataset: Any,
    num_classes: int,
    batch_size: int = 1,
    window: int | None = None,
    stride: int | None = None,
    ctx: Dist | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """mIoU, pixel accuracy, mean accuracy and per-class IoU (a list, NaN for a class never seen) of
    ``model`` on ``dataset`` (``dataset[i]`` = (image, targets); images of one size per batch), the
    confusion matrix summed over the split and the ranks of ``ctx``. ``limit``: the first this many samples."""
    ctx = ctx or Dist()
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if n == 0:
        raise ValueError("cannot evaluate on an empty split")
    was_training = model.training
    model.eval()
    matrix = ConfusionMatrix(num_classes)
    mine = list(range(ctx.rank, n, ctx.world))
    for lo in range(0, len(mine), batch_size):
        samples = [dataset[i] for i in mine[lo : lo + batch_size]]
        images = torch.stack([s[0] for s in samples]).to(ctx.device)
        labels = torch.stack([s[1] for s in samples]).to(ctx.device)
        matrix.update(predict(model, images, tuple(labels.shape[-2:]), window, stride), labels)
    model.train(was_training)
    matrix.all_sum(ctx)
    return {**matrix.compute(), "iou": matrix.iou().tolist(), "images": n}


# --- generated scenes --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScenesSetup(DigitsSetup):
    """What a run on generated scenes depends on (the digits' setup, its checks, and the decoder's);
    a run is resumed only for the same setup."""

    epochs: int = 12
    lr: float = 2e-3
    depth: int = 4
    decoder_attention: str = "sdpa"
    decoder: str = "mask_transformer"
    decoder_depth: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.decoder_depth, int) or isinstance(self.decoder_depth, bool) or self.decoder_depth < 1:
            raise ValueError(f"decoder_depth must be an int >= 1, got {self.decoder_depth!r}")
        if self.decoder not in ("mask_transformer", "linear"):
            raise ValueError(f"decoder must be 'mask_transformer' or 'linear', got {self.decoder!r}")
        registry.resolve(self.decoder_attention)


#: the patch size of the scenes' Segmenter: a 12 x 12 grid (N = 145 with the CLS token)
PATCH = 4


def make_scenes_model(setup: ScenesSetup) -> nn.Module:
    """The scenes' Segmenter: a ViT with 4 px patches on 48 px scenes, ``setup``'s width, depth, heads and attention."""
    from mita.models.segmenter import create_segmenter

    torch.manual_seed(setup.seed)
    names = ("embed_dim", "depth", "num_heads", "decoder", "attention", "decoder_attention", "decoder_depth")
    sizes = {name: getattr(setup, name) for name in names}
    return create_segmenter(
        "tiny", num_classes=NUM_CLASSES, img_size=SIZE, patch_size=PATCH, drop_path_rate=0.0, **sizes
    )


def train_scenes(
    setup: ScenesSetup,
    data: tuple[torch.Tensor, ...] | None,
    run_dir: str | Path,
    *,
    force: bool = False,
    progress: bool = True,
    build: Callable[[ScenesSetup], nn.Module] = make_scenes_model,
) -> tuple[nn.Module, dict[str, Any]]:
    """Train the scenes' Segmenter on ``data`` (default :func:`~.scenes.load_scenes` of ``setup.seed``) in
    ``run_dir`` with the shared trainer (AdamW, weight decay 0.01, a tenth of warm-up then cosine
    decay, a checkpoint every epoch, the test split's loss and pixel accuracy at the end), resuming an
    interrupted run there; another setup's run there is an error unless ``force``.

    Returns the trained model and a summary: test mIoU, pixel accuracy and training seconds.
    """
    data = data if data is not None else load_scenes(setup.seed)
    x_train, y_train, x_test, y_test = data
    train = train_section(setup, len(y_train), "training scenes")
    log_every = max(1, train["checkpoint_every"] // 4)
    config = {
        "train": {**train, "log_every": log_every, "eval_batch_size": 100},
        "task": "scenes",
        "setup": asdict(setup),
    }
    task = trainer.Task(
        build_model=lambda: build(setup),
        scores=SegmentationScores(),
        train_data=Tensors(x_train, y_train),
        eval_data={"test": Tensors(x_test, y_test)},
        identity={"task": "scenes", "attention": setup.attention, "decoder_attention": setup.decoder_attention},
        fingerprint={"train": trainer.tensor_digest(x_train, y_train), "test": trainer.tensor_digest(x_test, y_test)},
        name=f"scenes {setup.attention}",
    )
    model, seconds = fit(task, config, setup, run_dir, name="scenes", build=build, force=force, progress=progress)
    scores = evaluate_miou(model, Tensors(x_test, y_test), NUM_CLASSES, batch_size=100)
    return model, {**scores, "train_seconds": seconds}
