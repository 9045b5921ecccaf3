"""Shape scenes: an offline semantic-segmentation task, generated from a seed.

Each ``SIZE`` x ``SIZE`` RGB scene has a textured background (three dim random colour gratings of
random orientation and frequency, plus pixel noise) and 3 to 5 solid shapes of :data:`SHAPES`,
each 14-26 px across, in a random saturated colour at a random place (later shapes cover earlier
ones). Every pixel is labelled: 0 background, i + 1 for a pixel of a shape of kind i, so 7
classes. The colour says nothing of the kind and a disc, a ring, a square and a diamond share
their inner patches: a patch's class needs the outline of its shape, seen by other patches.
Scenes are made by torch's CPU generator from the seed: the same on any machine, no file; the
test scenes come from the same generator after the training scenes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["NUM_CLASSES", "SHAPES", "SIZE", "load_scenes", "make_scenes", "shape_mask"]

SIZE = 48
SHAPES = ("disc", "ring", "square", "diamond", "triangle", "cross")
NUM_CLASSES = len(SHAPES) + 1  # and the background
SHAPE_PX = (14, 26)
SHAPES_PER_SCENE = (3, 5)


def shape_mask(kind: str, dy: torch.Tensor, dx: torch.Tensor, radius: float) -> torch.Tensor:
    """Where a shape of ``kind`` centred at 0 with ``radius`` covers the offsets (dy, dx) (bool, their shape)."""
    ay, ax = dy.abs(), dx.abs()
    if kind == "disc":
        return dy**2 + dx**2 <= radius**2
    if kind == "ring":
        return ((dy**2 + dx**2) <= radius**2) & ((dy**2 + dx**2) >= (0.55 * radius) ** 2)
    if kind == "square":
        return (ay <= 0.8 * radius) & (ax <= 0.8 * radius)
    if kind == "diamond":
        return ay + ax <= radius
    if kind == "triangle":  # apex up, base at 0.7 radius below the centre
        return (dy <= 0.7 * radius) & (ax <= 0.6 * (dy + radius))
    if kind == "cross":
        return ((ax <= radius / 3) & (ay <= radius)) | ((ay <= radius / 3) & (ax <= radius))
    raise ValueError(f"kind must be one of {list(SHAPES)}, got {kind!r}")


def backgrounds(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` textured backgrounds (n, 3, SIZE, SIZE) in [0, 1]: three dim colour gratings and noise."""
    axis = torch.arange(SIZE, dtype=torch.float32)
    ys, xs = torch.meshgrid(axis, axis, indexing="ij")
    image = torch.zeros(n, 3, SIZE, SIZE)
    for _ in range(3):
        angle = math.pi * torch.rand(n, 1, 1, generator=generator)
        freq = 0.15 + 0.6 * torch.rand(n, 1, 1, generator=generator)
        phase = 2 * math.pi * torch.rand(n, 1, 1, generator=generator)
        wave = torch.sin(freq * (xs * angle.cos() + ys * angle.sin()) + phase)  # (n, SIZE, SIZE)
        colour = torch.rand(n, 3, 1, 1, generator=generator)
        image += colour * (0.5 + 0.5 * wave[:, None]) * 0.2
    image += 0.05 * torch.randn(n, 3, SIZE, SIZE, generator=generator)
    return image.clamp(0, 1)


def bright_colour(generator: torch.Generator) -> torch.Tensor:
    """A saturated random colour (3, 1, 1): one channel 1, one 0, one uniform, in a random order."""
    channels = torch.tensor([1.0, 0.0, float(torch.rand((), generator=generator))])
    return channels[torch.randperm(3, generator=generator)][:, None, None]


def make_scenes(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` scenes (n, 3, SIZE, SIZE) in [0, 1] and their labels (n, SIZE, SIZE) int64 (module doc)."""
    images = backgrounds(n, generator)
    labels = torch.zeros(n, SIZE, SIZE, dtype=torch.long)
    axis = torch.arange(SIZE, dtype=torch.float32)
    ys, xs = torch.meshgrid(axis, axis, indexing="ij")
    counts = torch.randint(SHAPES_PER_SCENE[0], SHAPES_PER_SCENE[1] + 1, (n,), generator=generator)
    for i in range(n):
        for _ in range(int(counts[i])):
            kind = int(torch.randint(len(SHAPES), (), generator=generator))
            radius = (SHAPE_PX[0] + (SHAPE_PX[1] - SHAPE_PX[0]) * float(torch.rand((), generator=generator))) / 2
            cy, cx = (radius + (SIZE - 2 * radius) * torch.rand(2, generator=generator)).tolist()
            mask = shape_mask(SHAPES[kind], ys - cy, xs - cx, radius)
            images[i][:, mask] = bright_colour(generator)[:, :, 0].expand(3, int(mask.sum()))
            labels[i][mask] = kind + 1
    return images, labels


def load_scenes(seed: int = 0, train: int = 3000, test: int = 500) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): scenes standardised with the training scenes' per-channel
    mean and std, and their labels; seeded, made on the fly."""
    generator = torch.Generator().manual_seed(seed)
    x_train, y_train = make_scenes(train, generator)
    x_test, y_test = make_scenes(test, generator)
    mean, std = x_train.mean((0, 2, 3), keepdim=True), x_train.std((0, 2, 3), keepdim=True)
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test
