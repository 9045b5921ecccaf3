"""The vision experiments (:mod:`mita_experiments.vision.experiments`: attention swap, robustness over m and k) on
moving digits, with a video ViT whose MiTA layers pool landmarks on its 3-D tubelet grid."""

from __future__ import annotations

import math

import torch.nn as nn

from ..vision.digits import DigitsSetup
from ..vision.experiments import Task, sized_options
from . import moving_digits as md
from .model import VideoViT

TUBELET = (2, 4, 4)
GRID = (md.FRAMES // TUBELET[0], md.SIZE // TUBELET[1], md.SIZE // TUBELET[2])  # (4, 8, 8): N = 256
TOKENS = math.prod(GRID)
#: each method's options at N = 256 on the (4, 8, 8) grid (MiTA's, agent's and MHLA's landmarks: cubes, 2 x 2 x 2 = 8)
VIDEO_OPTIONS = sized_options(landmarks=8, topk=32, block_size=32, window=16, nystrom=32)
SWAP_EXTRA = ("mita:num_landmarks=8,topk=8", "mita:num_landmarks=27,topk=64", "mita:num_landmarks=64,topk=128")
ROBUSTNESS_M = (1, 8, 27, 64)
ROBUSTNESS_K = (4, 8, 16, 32, 64, 128, 256)
#: the training defaults of the video experiments (6-12 minutes on one shared CPU core)
VIDEO_SETUP = DigitsSetup(epochs=12, batch_size=32, lr=3e-3, embed_dim=64, depth=3, num_heads=4)


def make_video_vit(setup: DigitsSetup) -> nn.Module:
    """The moving-digits video ViT with ``setup``'s width, depth, heads, seed and attention."""
    import torch

    from mita.models.convert import convert

    torch.manual_seed(setup.seed)
    model = VideoViT(md.FRAMES, md.SIZE, 1, 10, TUBELET, setup.embed_dim, setup.depth, setup.num_heads)
    return convert(model, setup.attention) if setup.attention != "sdpa" else model


MOVING_DIGITS = Task(
    "moving digits",
    f"moving digits ({md.FRAMES} frames of {md.SIZE}x{md.SIZE}, two digits of {md.DIGIT} px, label: the class of the "
    f"faster one), tubelets {TUBELET} ({GRID} grid, no CLS, N = {TOKENS})",
    md.load_moving_digits,
    make_video_vit,
    (md.FRAMES, 1, md.SIZE, md.SIZE),
    VIDEO_OPTIONS,
    SWAP_EXTRA,
)
