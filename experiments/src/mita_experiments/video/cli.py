"""``mita video``: the moving-digits experiments (swap, robustness) and FLOP tables.

Speed is ``mita bench video`` (a whole VideoMAE) and ``mita bench --preset video`` (the op alone).
"""

from __future__ import annotations

import argparse

from ..utils.flags import add_command_group
from ..vision.cli import add_digits_arguments, add_flops_parser, command_line, digits_setup, write_report
from .experiments import ROBUSTNESS_K, ROBUSTNESS_M, VIDEO_SETUP


def cmd_swap(args: argparse.Namespace) -> int:
    from ..vision.experiments import prepare_output, run_swap
    from .experiments import MOVING_DIGITS

    out = prepare_output(args.out, args.force)
    setup = digits_setup(args, "sdpa")
    run_swap(out, setup, args.attention, command_line(args), force=args.force, task=MOVING_DIGITS)
    print(f"wrote {out / 'report.md'}")
    return 0


def cmd_robustness(args: argparse.Namespace) -> int:
    from ..vision.experiments import prepare_output, run_robustness
    from .experiments import MOVING_DIGITS

    out = prepare_output(args.out, args.force)
    setup = digits_setup(args, args.train_attention)
    ms, ks = tuple(args.m), tuple(args.k)
    run_robustness(out, setup, ms, ks, command_line(args), force=args.force, task=MOVING_DIGITS)
    print(f"wrote {out / 'report.md'}")
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    """``mita video flops``: FLOP and parameter tables of VideoMAE encoders, full attention against MiTA."""
    from ..vision.experiments import prepare_output
    from ..vision.flops import markdown_table
    from . import flops

    out = prepare_output(args.out, args.force) if args.out else None  # checked before the tables are computed
    rows = [flops.backbone_row(b, counted=not args.no_counted) for b in flops.TABLE_BACKBONES]
    text = (
        "## FLOPs and parameters of VideoMAE encoders, full attention vs MiTA "
        f"(m = k = {flops.TOPK} on a {flops.LANDMARKS} landmark grid; batch 1, FLOPs = 2 x MACs)\n\n"
        + markdown_table(rows)
    )
    print(text)
    if out is not None:
        print(f"wrote {write_report(out, 'Video FLOP tables', args, text)}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    video = add_command_group(sub, "video", "video: moving-digits swap and robustness, VideoMAE FLOPs", __doc__)

    p = video.add_parser("swap", help="train a video ViT with SDPA on moving digits, evaluate with MiTA and the others")
    add_digits_arguments(p, "runs/video/swap", VIDEO_SETUP)
    p.add_argument("--attention", nargs="+", help="configs to evaluate (default: every registered method)")
    p.set_defaults(func=cmd_swap)

    p = video.add_parser("robustness", help="train MiTA with small m, k on moving digits; evaluate with larger ones")
    add_digits_arguments(p, "runs/video/robustness", VIDEO_SETUP)
    p.add_argument("--train-attention", default="mita:num_landmarks=8,topk=16", help="the MiTA config trained")
    p.add_argument("--m", type=int, nargs="+", default=list(ROBUSTNESS_M), help="landmarks (cubes)")
    p.add_argument("--k", type=int, nargs="+", default=list(ROBUSTNESS_K), help="keys per expert")
    p.set_defaults(func=cmd_robustness)

    help = "FLOP and parameter tables of VideoMAE encoders, full attention vs MiTA"
    add_flops_parser(video, help, "also write report.md here", cmd_flops)
