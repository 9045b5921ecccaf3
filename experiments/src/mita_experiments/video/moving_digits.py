"""Moving digits: an offline video task built from scikit-learn's 8x8 handwritten digits.

Each clip shows two different digits (upscaled to ``DIGIT`` px) moving across a dark
``SIZE`` x ``SIZE`` canvas for ``FRAMES`` frames, each in a straight line at its own speed,
bouncing off the edges; one digit is slow (``SLOW`` px per frame), the other fast (``FAST``).
The label is the fast digit's class (0-9): a single frame shows two digits and cannot say
which is the fast one (at best 50%), so the label needs the motion across frames and the
identity of the digit. Clips are generated on the fly from a seed; the digits of the train
and test clips come from disjoint, stratified halves of the 1,797 images.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FRAMES = 8
SIZE = 32
DIGIT = 12
SLOW = (0.3, 0.9)
FAST = (1.8, 3.0)


def digit_images(seed: int = 0, test_fraction: float = 0.3) -> tuple[torch.Tensor, ...]:
    """(train_images, train_labels, test_images, test_labels): digits in [0, 1], (n, DIGIT, DIGIT)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    images = F.interpolate(images, size=(DIGIT, DIGIT), mode="bilinear", align_corners=False)[:, 0].clamp(0, 1)
    labels = torch.tensor(data.target)
    train, test = train_test_split(range(len(labels)), test_size=test_fraction, random_state=seed, stratify=data.target)
    return images[train], labels[train], images[test], labels[test]


def bounce(start: torch.Tensor, velocity: torch.Tensor, frames: int, span: int) -> torch.Tensor:
    """Positions in [0, span] over ``frames`` frames of points moving at ``velocity``, reflected at the edges.

    ``start`` and ``velocity`` are (...,); returns (..., frames), rounded to whole pixels.
    """
    path = start[..., None] + velocity[..., None] * torch.arange(frames, dtype=start.dtype)
    folded = torch.remainder(path, 2 * span)  # a triangle wave: out and back between 0 and span
    return (span - (span - folded).abs()).round().long()


def make_clips(
    n: int, images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` clips (n, FRAMES, 1, SIZE, SIZE) of ``images`` (m, DIGIT, DIGIT); labels (n,): the fast digit's class."""
    # two digits of different classes: redraw the second where it matches the first
    first = torch.randint(len(labels), (n,), generator=generator)
    second = torch.randint(len(labels), (n,), generator=generator)
    for _ in range(100):
        same = labels[first] == labels[second]
        if not same.any():
            break
        second[same] = torch.randint(len(labels), (int(same.sum()),), generator=generator)
    which = torch.stack([first, second], 1)  # (n, 2); digit 1 is the fast one
    lo = torch.tensor([SLOW[0], FAST[0]])
    hi = torch.tensor([SLOW[1], FAST[1]])
    speed = lo + (hi - lo) * torch.rand(n, 2, generator=generator)
    angle = 2 * math.pi * torch.rand(n, 2, generator=generator)
    span = SIZE - DIGIT
    start = span * torch.rand(n, 2, 2, generator=generator)  # (clip, digit, y/x)
    velocity = torch.stack([speed * angle.sin(), speed * angle.cos()], -1)
    pos = bounce(start, velocity, FRAMES, span)  # (n, 2, 2, FRAMES)
    clips = torch.zeros(n, FRAMES, SIZE, SIZE)
    offsets = torch.arange(DIGIT)
    b = torch.arange(n)[:, None, None, None]
    t = torch.arange(FRAMES)[None, :, None, None]
    for d in range(2):
        ys = pos[:, d, 0, :, None, None] + offsets[:, None]  # (n, FRAMES, DIGIT, 1)
        xs = pos[:, d, 1, :, None, None] + offsets  # (n, FRAMES, 1, DIGIT)
        clips[b, t, ys, xs] = torch.maximum(clips[b, t, ys, xs], images[which[:, d]][:, None])
    return clips[:, :, None], labels[which[:, 1]]


def load_moving_digits(seed: int = 0, train_clips: int = 4000, test_clips: int = 1000) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): clips (n, FRAMES, 1, SIZE, SIZE) standardised with the training
    clips' mean and std, and the fast digit's class; seeded, made on the fly (no file)."""
    generator = torch.Generator().manual_seed(seed)
    train_images, train_labels, test_images, test_labels = digit_images(seed)
    x_train, y_train = make_clips(train_clips, train_images, train_labels, generator)
    x_test, y_test = make_clips(test_clips, test_images, test_labels, generator)
    mean, std = x_train.mean(), x_train.std()
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test
