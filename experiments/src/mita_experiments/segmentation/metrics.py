"""mIoU, per-class IoU and pixel accuracy, accumulated over a whole data set.

The confusion matrix of every labelled pixel is summed over the images (and over the ranks of a
DDP run) before any ratio is taken, so the IoU of a class is its intersections summed over the
data set over its unions summed the same way (mmsegmentation's and Segmenter's definition), not
a mean of per-image IoUs. A class with no pixel in the labels nor in the predictions has no
IoU (NaN) and takes no part in the mean.
"""

from __future__ import annotations

import torch

from ..utils.distributed import Dist

__all__ = ["IGNORE_INDEX", "ConfusionMatrix"]

#: the label of pixels that take no part (ADE20K's "other" after reducing the zero label, padding)
IGNORE_INDEX = 255


class ConfusionMatrix:
    """Counts of (label, prediction) pairs over every labelled pixel seen.

    Args:
        num_classes (int): K; labels and predictions are in [0, K).
        ignore_index (int): the label of pixels left out. Default: 255.
    """

    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.counts = torch.zeros(num_classes, num_classes, dtype=torch.float64)  # [label, prediction]

    def update(self, prediction: torch.Tensor, label: torch.Tensor) -> None:
        """Add a batch: ``prediction`` (class indices, or logits (B, K, H, W) whose argmax is taken) and
        ``label`` (B, H, W) of ints, ``ignore_index`` where unlabelled."""
        if prediction.dim() == label.dim() + 1:
            prediction = prediction.argmax(1)
        if prediction.shape != label.shape:
            raise ValueError(f"prediction {tuple(prediction.shape)} and label {tuple(label.shape)} differ in shape")
        keep = label != self.ignore_index
        label, prediction = label[keep].long(), prediction[keep].long()
        bad = (label < 0) | (label >= self.num_classes)
        if bad.any():
            raise ValueError(
                f"labels must be in [0, {self.num_classes}) or {self.ignore_index} (ignored), "
                f"got {label[bad][0].item()}"
            )
        index = (label * self.num_classes + prediction).cpu()
        self.counts += torch.bincount(index, minlength=self.num_classes**2).reshape(self.counts.shape).double()

    def all_sum(self, ctx: Dist) -> None:
        """Sum the counts over the ranks of ``ctx`` (a no-op in one process)."""
        if ctx.world > 1:
            self.counts = torch.tensor(ctx.all_sum(self.counts.flatten().tolist()), dtype=torch.float64).reshape(
                self.counts.shape
            )

    def iou(self) -> torch.Tensor:
        """Per-class IoU (K,): intersection / union over everything seen; NaN for a class never seen."""
        intersection = self.counts.diagonal()
        union = self.counts.sum(0) + self.counts.sum(1) - intersection
        return torch.where(union > 0, intersection / union.clamp_min(1), torch.nan)

    def compute(self) -> dict[str, float]:
        """``mIoU`` (mean IoU over the classes seen), ``pixel_accuracy`` (right labelled pixels over all
        labelled pixels) and ``mean_accuracy`` (per-class recall, mean over the labelled classes), in [0, 1]."""
        total = float(self.counts.sum())
        if total == 0:
            raise ValueError("no labelled pixel was seen: nothing to score")
        labelled = self.counts.sum(1)
        recall = self.counts.diagonal()[labelled > 0] / labelled[labelled > 0]
        return {
            "mIoU": float(self.iou().nanmean()),
            "pixel_accuracy": float(self.counts.diagonal().sum()) / total,
            "mean_accuracy": float(recall.mean()),
        }
