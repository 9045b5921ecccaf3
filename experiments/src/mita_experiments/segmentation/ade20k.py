"""ADE20K (SceneParsing, 150 classes) in its release layout, with the usual training and evaluation pipelines.

The release (``ADEChallengeData2016.zip``, not downloaded here) unpacks to::

    ADEChallengeData2016/images/training/ADE_train_00000001.jpg       20,210 images
    ADEChallengeData2016/images/validation/ADE_val_00000001.jpg        2,000 images
    ADEChallengeData2016/annotations/training/ADE_train_00000001.png   8-bit label maps
    ADEChallengeData2016/annotations/validation/ADE_val_00000001.png

Label 0 is "other" and takes no part: labels are reduced by one (0 -> 255, ignored; 1..150 -> 0..149).
The training pipeline is mmsegmentation's for ADE20K (which Segmenter uses): a resize of the
(2048, 512) scale by a random ratio in [0.5, 2.0], keeping the aspect ratio; a random 512 x 512
crop that no class fills to 75% or more (up to 10 draws); a horizontal flip with probability 0.5;
photometric distortion (brightness, contrast, saturation, hue, each with probability 0.5); ImageNet
normalisation; padding to the crop (image 0, label 255). Evaluation is single-scale: the image
resized into the (2048, 512) scale, the labels kept at their own size (the logits are resized to them).

Every random draw comes from ``generator`` (default: torch's global RNG, which the trainer seeds
before each batch), so a transform is the same under the same seed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .metrics import IGNORE_INDEX

__all__ = ["ADE20K", "NUM_CLASSES", "SPLITS", "EvalTransform", "TrainTransform", "find_root", "reduce_zero_label"]

NUM_CLASSES = 150
SPLITS = ("training", "validation")
MEAN = (123.675, 116.28, 103.53)  # ImageNet, on 0-255 pixels
STD = (58.395, 57.12, 57.375)


def find_root(path: str | Path) -> Path:
    """The ``ADEChallengeData2016`` folder: ``path`` itself or its child of that name; a FileNotFoundError
    says what is missing."""
    path = Path(path)
    for root in (path, path / "ADEChallengeData2016"):
        if (root / "images").is_dir() and (root / "annotations").is_dir():
            return root
    raise FileNotFoundError(
        f"--data {path} is not ADE20K in its release layout: ADEChallengeData2016/images/{{training,validation}}/*.jpg "
        "and ADEChallengeData2016/annotations/{training,validation}/*.png"
    )


def reduce_zero_label(label: torch.Tensor) -> torch.Tensor:
    """ADE20K's labels (uint8, 0 = other) as training targets (int64): 0 -> 255 (ignored), k -> k - 1."""
    label = label.long()
    return torch.where(label == 0, IGNORE_INDEX, label - 1)


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator))


def _chance(p: float, generator: torch.Generator | None) -> bool:
    return float(torch.rand((), generator=generator)) < p


def _resize(image: torch.Tensor, label: torch.Tensor | None, size: tuple[int, int]):
    """Image (3, H, W) float resized bilinearly, labels (H, W) by nearest neighbour, to ``size``."""
    image = F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0]
    if label is not None:
        label = F.interpolate(label[None, None].float(), size=size, mode="nearest")[0, 0].long()
    return image, label


def _scaled_size(height: int, width: int, scale: tuple[int, int]) -> tuple[int, int]:
    """(H, W) scaled by one factor so the long side fits ``scale[0]`` and the short side ``scale[1]``."""
    factor = min(max(scale) / max(height, width), min(scale) / min(height, width))
    return max(1, round(height * factor)), max(1, round(width * factor))


def _normalise(image: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    return (image - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def photometric_distortion(image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """mmsegmentation's photometric distortion of a float image (3, H, W) in [0, 255]: brightness
    (+U(-32, 32)), contrast (xU(0.5, 1.5)) before or after saturation (xU(0.5, 1.5)) and hue
    (+U(-18, 18) degrees), each applied with probability 0.5."""
    from torchvision.transforms.v2 import functional as TF

    def contrast(x: torch.Tensor) -> torch.Tensor:
        return (x * _uniform(0.5, 1.5, generator)).clamp(0, 255) if _chance(0.5, generator) else x

    if _chance(0.5, generator):
        image = (image + _uniform(-32, 32, generator)).clamp(0, 255)
    contrast_first = _chance(0.5, generator)
    if contrast_first:
        image = contrast(image)
    if _chance(0.5, generator):
        image = TF.adjust_saturation(image / 255, _uniform(0.5, 1.5, generator)).clamp(0, 1) * 255
    if _chance(0.5, generator):
        image = TF.adjust_hue(image / 255, _uniform(-18, 18, generator) / 360) * 255
    if not contrast_first:
        image = contrast(image)
    return image


@dataclass(frozen=True)
class TrainTransform:
    """The training pipeline (module doc) on an image (3, H, W) uint8 and its targets (H, W) int64.

    Args:
        crop (int): the square crop's side. Default: 512.
        scale (tuple): (long, short) sides the image is resized into before the random ratio. Default: (2048, 512).
        ratio_range (tuple): the random ratio's range. Default: (0.5, 2.0).
        cat_max_ratio (float): a crop in which one class covers this share of the labelled pixels or
            more is drawn again (at most 10 draws). Default: 0.75.
        flip (float): probability of a horizontal flip. Default: 0.5.
        photometric (bool): apply :func:`photometric_distortion`. Default: True.
        mean, std: per-channel normalisation on 0-255 pixels. Default: ImageNet's.
    """

    crop: int = 512
    scale: tuple[int, int] = (2048, 512)
    ratio_range: tuple[float, float] = (0.5, 2.0)
    cat_max_ratio: float = 0.75
    flip: float = 0.5
    photometric: bool = True
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD

    def __post_init__(self) -> None:
        if not (isinstance(self.crop, int) and self.crop >= 1):
            raise ValueError(f"crop must be an int >= 1, got {self.crop!r}")
        low, high = self.ratio_range
        if not 0 < low <= high:
            raise ValueError(f"ratio_range must be (low, high) with 0 < low <= high, got {self.ratio_range}")
        if not 0 < self.cat_max_ratio <= 1 or not 0 <= self.flip <= 1:
            raise ValueError("cat_max_ratio must be in (0, 1] and flip in [0, 1]")

    def crop_origin(self, label: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
        """The crop's top-left corner: drawn again while one class covers ``cat_max_ratio`` or more of it."""
        H, W = label.shape
        for _ in range(10):
            top = int(torch.randint(max(H - self.crop, 0) + 1, (), generator=generator))
            left = int(torch.randint(max(W - self.crop, 0) + 1, (), generator=generator))
            window = label[top : top + self.crop, left : left + self.crop]
            counts = torch.bincount(window[window != IGNORE_INDEX].flatten(), minlength=1)
            counts = counts[counts > 0]
            if self.cat_max_ratio >= 1 or (len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio):
                break
        return top, left

    def __call__(
        self, image: torch.Tensor, label: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(image (3, crop, crop) float32 normalised, targets (crop, crop) int64 with 255 where ignored or padded)."""
        ratio = _uniform(*self.ratio_range, generator)
        scale = (round(self.scale[0] * ratio), round(self.scale[1] * ratio))
        image, label = _resize(image.float(), label, _scaled_size(*label.shape, scale))
        top, left = self.crop_origin(label, generator)
        image = image[:, top : top + self.crop, left : left + self.crop]
        label = label[top : top + self.crop, left : left + self.crop]
        if _chance(self.flip, generator):
            image, label = image.flip(-1), label.flip(-1)
        if self.photometric:
            image = photometric_distortion(image, generator)
        image = _normalise(image, self.mean, self.std)
        pad_h, pad_w = self.crop - image.shape[1], self.crop - image.shape[2]
        image = F.pad(image, (0, pad_w, 0, pad_h))
        label = F.pad(label, (0, pad_w, 0, pad_h), value=IGNORE_INDEX)
        return image.contiguous(), label.contiguous()


@dataclass(frozen=True)
class EvalTransform:
    """Single-scale evaluation: the image resized into ``scale`` (long, short) keeping its aspect ratio and
    normalised; the targets (H, W) left at their own size. Default scale (2048, 512): the short side 512."""

    scale: tuple[int, int] = (2048, 512)
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD

    def __call__(self, image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        image, _ = _resize(image.float(), None, _scaled_size(*label.shape, self.scale))
        return _normalise(image, self.mean, self.std), label


class ADE20K:
    """One split of ADE20K in its release layout: ``dataset[i]`` = (image, targets) after ``transform``.

    Args:
        root (str | Path): ``ADEChallengeData2016`` or the folder holding it.
        split (str): "training" or "validation".
        transform: ``transform(image (3, H, W) uint8, targets (H, W) int64) -> (image, targets)``;
            None gives the decoded image and the reduced labels. Default: None.
        limit (int | None): the first this many images (sorted by name) only. Default: None (all).
    """

    def __init__(self, root: str | Path, split: str, transform=None, limit: int | None = None) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
        self.root, self.split, self.transform = find_root(root), split, transform
        images = sorted((self.root / "images" / split).glob("*.jpg"))
        if not images:
            raise FileNotFoundError(f"no images in {self.root / 'images' / split} (expected *.jpg)")
        images = images[:limit] if limit is not None else images
        self.samples = [(path, self.root / "annotations" / split / f"{path.stem}.png") for path in images]
        missing = [str(label) for _, label in self.samples if not label.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} label map(s) missing, first: {missing[0]}")

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded image (3, H, W) uint8 (RGB) and reduced labels (H, W) int64 of sample ``index``."""
        import numpy as np
        from PIL import Image

        image_path, label_path = self.samples[index]
        with Image.open(image_path) as img:
            image = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)
        with Image.open(label_path) as lab:
            if lab.mode not in ("L", "P"):
                raise ValueError(f"{label_path} is a {lab.mode} image; ADE20K label maps are 8-bit (mode L or P)")
            label = torch.from_numpy(np.array(lab))
        if label.shape != image.shape[1:]:
            raise ValueError(f"{label_path} is {tuple(label.shape)} but its image is {tuple(image.shape[1:])}")
        return image, reduce_zero_label(label)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.read(index)
        return (image, label) if self.transform is None else self.transform(image, label)

    def digest(self) -> str:
        """A SHA-256 of the file names and sizes: what the trainer checks on resume."""
        h = hashlib.sha256()
        for image, label in self.samples:
            h.update(f"{image.name}\t{image.stat().st_size}\t{label.stat().st_size}\n".encode())
        return h.hexdigest()
