"""``mita bench seg``: a whole Segmenter forward (ViT encoder and Mask Transformer) with MiTA against softmax attention.

Random weights (no download), 150 classes. For each ViT size, three variants share their weights:
softmax attention everywhere (``sdpa``: timm's), MiTA in the encoder, and MiTA in encoder and
decoder (m = k = 49 unless ``--landmarks`` / ``--topk``); each round times one forward of each in
eval mode under ``torch.inference_mode()``, alternating, after a warm-up call each, and the result
is the median over rounds (:func:`mita_experiments.benchmarks.models.side_by_side`).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch

from ..benchmarks.models import (
    OnRound,
    add_common_arguments,
    check_at_least_one,
    run_points,
    side_by_side,
    timed_rows,
)

HELP = "a whole Segmenter forward (ViT + Mask Transformer), MiTA vs softmax attention, in images/s"
METHOD = (
    "Segmenter with a ViT-{sizes} encoder and a 2-block Mask Transformer, 150 classes, {image} px, random "
    "weights, float32, {threads} torch threads. Each round times one forward of each variant in eval mode under "
    "torch.inference_mode(), alternating, after one warm-up call each; the seconds are the median over the "
    "rounds and the speed-up is over softmax attention measured in the same process. MiTA: m = {m}, k = {k}. "
    "finite: that variant's logits have no NaN or infinity."
)
SIZES = ("tiny", "small")


def variants(size: str, image: int, m: int, k: int, depth: int | None = None) -> dict[str, torch.nn.Module]:
    """``{"sdpa", "mita enc", "mita enc+dec"}``: one random Segmenter of ``size`` at ``image`` px and two
    copies with MiTA swapped in (the same weights), in eval mode."""
    from mita.models.segmenter import create_segmenter

    torch.manual_seed(0)
    extra = {} if depth is None else {"depth": depth}
    base = create_segmenter(size, img_size=image, attention="sdpa", drop_path_rate=0.0, **extra).eval()
    config = f"mita:num_landmarks={m},topk={k}"
    encoder, both = copy.deepcopy(base), copy.deepcopy(base)
    encoder.set_attention(config)
    both.set_attention(config, decoder=config)
    return {"sdpa": base, "mita enc": encoder, "mita enc+dec": both}


@torch.inference_mode()
def measure(
    size: str,
    image: int,
    batch: int,
    rounds: int,
    m: int = 49,
    k: int = 49,
    depth: int | None = None,
    on_round: OnRound | None = None,
) -> list[dict[str, Any]]:
    """Seconds per forward and images/s of each variant (:func:`variants`), median over ``rounds``."""
    models = variants(size, image, m, k, depth)
    images = torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(1))
    calls = {name: (lambda model=model: model(images)) for name, model in models.items()}
    timed = side_by_side(calls, rounds, "sdpa", on_round)
    encoder = f"ViT-{size}" + (f" ({depth} blocks)" if depth else "")
    return timed_rows(timed, {"encoder": encoder, "px": image, "batch": batch}, batch, "images", rounds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mita bench seg``."""
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=["tiny", "small", "base", "large"])
    p.add_argument("--image", type=int, default=512, help="image side in px (a multiple of 16)")
    p.add_argument("--batch", type=int, default=1, help="images per forward")
    p.add_argument("--landmarks", type=int, default=49, help="MiTA's m (a perfect square)")
    p.add_argument("--topk", type=int, default=49, help="MiTA's k")
    p.add_argument("--depth", type=int, help="encoder blocks (default: the size's 12 or 24; fewer for a quick look)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (one call of each variant per round)")
    add_common_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Each ViT size side by side; results.csv and results.md in ``--out``."""
    check_at_least_one(args, "image", "batch", "landmarks", "topk", "rounds")
    if args.image % 16:
        raise ValueError(f"--image must be a multiple of the 16 px patch, got {args.image}")
    if args.depth is not None and args.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {args.depth}")
    points = [
        (
            f"ViT-{size}",
            lambda on_round, size=size: measure(
                size, args.image, args.batch, args.rounds, args.landmarks, args.topk, args.depth, on_round
            ),
        )
        for size in args.sizes
    ]

    def method(threads: int) -> str:
        sizes = "/".join(args.sizes)
        return METHOD.format(sizes=sizes, image=args.image, threads=threads, m=args.landmarks, k=args.topk)

    return run_points(args, "seg", points, "Whole-model speed: Segmenter, MiTA vs softmax attention", method)
