"""``mita bench video``: a whole Hugging Face VideoMAE forward with MiTA against SDPA, side by side.

Random weights (no download). The two models share their weights; each round times one call of
each, alternating, so both see the same machine load; the result is the median over rounds
(:func:`mita_experiments.benchmarks.models.side_by_side`). The op alone at video shapes is
``mita bench --preset video``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..video.flops import TOPK, VideoBackbone, landmarks
from .models import OnRound, add_common_arguments, check_at_least_one, run_points, side_by_side, timed_rows

HELP = "a whole Hugging Face VideoMAE forward, MiTA vs SDPA, in clips/s"
METHOD = (
    "VideoMAE-B widths (768 wide, 12 heads of 64), 224 px, random weights, float32, {threads} torch threads. "
    "Each round times one forward of each model under torch.inference_mode(), alternating, after one "
    "warm-up call each; the seconds are the median over the rounds and the speed-up is over SDPA measured "
    "in the same process. MiTA: m = {landmarks} landmarks, k = {topk}. finite: that model's output has no "
    "NaN or infinity."
)


def videomae_models(backbone: VideoBackbone) -> dict[str, torch.nn.Module]:
    """``{"sdpa": ..., "mita": ...}``: the same random VideoMAE encoder with each attention, in eval mode."""
    from transformers import VideoMAEModel

    from mita.integrations import hf  # registers "mita"

    config = backbone.config()
    config.mita_num_landmarks, config.mita_topk = list(landmarks(backbone)), TOPK
    torch.manual_seed(0)
    sdpa = VideoMAEModel._from_config(config, attn_implementation="sdpa").eval()
    mita = VideoMAEModel._from_config(config, attn_implementation=hf.NAME).eval()
    mita.load_state_dict(sdpa.state_dict())
    return {"sdpa": sdpa, "mita": mita}


@torch.inference_mode()
def clip_throughput(
    backbone: VideoBackbone, batch: int = 1, rounds: int = 3, on_round: OnRound | None = None
) -> list[dict[str, Any]]:
    """Seconds per forward and clips/s of each attention at ``batch`` clips, median over ``rounds``
    alternating rounds after one warm-up call each."""
    models = videomae_models(backbone)
    clips = torch.randn(batch, backbone.frames, 3, backbone.image_size, backbone.image_size)
    mita = f"mita m={landmarks(backbone)} k={TOPK}"
    calls = {
        "sdpa" if name == "sdpa" else mita: (lambda model=model: model(clips).last_hidden_state)
        for name, model in models.items()
    }
    timed = side_by_side(calls, rounds, "sdpa", on_round)
    return timed_rows(timed, {"model": backbone.name, "N": backbone.tokens, "batch": batch}, batch, "clips", rounds)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mita bench video``."""
    p.add_argument("--frames", type=int, nargs="+", default=[16], help="clip lengths (16: N = 1,568; 32: N = 3,136)")
    p.add_argument("--batch", type=int, default=1, help="clips per forward")
    p.add_argument("--layers", type=int, default=12, help="encoder layers (12 is VideoMAE-B)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (one call of each attention per round)")
    add_common_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Each clip length side by side; results.csv and results.md in ``--out``."""
    check_at_least_one(args, "batch", "layers", "rounds")
    bad = [f for f in args.frames if f < 2 or f % 2]
    if bad:
        raise ValueError(f"--frames must be even numbers >= 2 (tubelets of 2 frames), got {bad}")
    backbones = [VideoBackbone(f"VideoMAE-B, {f} frames", 768, args.layers, 12, frames=f) for f in args.frames]
    points = [(b.name, lambda on_round, b=b: clip_throughput(b, args.batch, args.rounds, on_round)) for b in backbones]
    title = f"Whole-model speed: a {args.layers}-layer VideoMAE-B forward, MiTA vs SDPA"
    return run_points(
        args,
        "video",
        points,
        title,
        lambda threads: METHOD.format(threads=threads, landmarks=landmarks(backbones[-1]), topk=TOPK),
    )
