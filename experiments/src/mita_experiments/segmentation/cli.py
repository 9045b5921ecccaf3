"""``mita seg``: Segmenter with MiTA for semantic segmentation.

    mita seg train  --data ADEChallengeData2016 --out runs/seg-t-mita            # ADE20K on the trainer (torchrun: DDP)
    mita seg eval   --data ADEChallengeData2016 --checkpoint runs/seg-t-sdpa --attention mita:num_landmarks=49,topk=49
    mita seg scenes --out runs/seg/scenes --threads 1   # offline: SDPA vs MiTA, the swap, m and k, on generated scenes
    mita seg flops  --out runs/seg/flops                # the whole Segmenter's FLOPs at 512 px, dense vs MiTA

Whole-model speed is ``mita bench seg``.
"""

from __future__ import annotations

import argparse
import json

from ..utils.flags import add_command_group, add_force, add_out
from ..vision.cli import add_digits_arguments, add_flops_parser, command_line, set_threads, write_report
from .task import ScenesSetup


def cmd_train(args: argparse.Namespace) -> int:
    """``mita seg train``: Segmenter on ADE20K (see :mod:`mita_experiments.segmentation.train`)."""
    from .train import run

    run(args)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``mita seg eval``: mIoU of a checkpoint on ADE20K's validation split, optionally with another attention."""
    from ..utils.distributed import distributed
    from ..utils.files import atomic_write_text, check_output_file
    from .train import evaluate

    out = check_output_file(args.out, force=args.force) if args.out else None
    with distributed(args.device) as ctx:
        result = evaluate(args, ctx)
    if ctx.main:
        text = json.dumps(result, indent=2)
        print(text)
        if out is not None:
            atomic_write_text(out, text + "\n")
    return 0


def cmd_scenes(args: argparse.Namespace) -> int:
    """``mita seg scenes``: the offline experiment on generated scenes (:mod:`.experiments`)."""
    from ..vision.experiments import prepare_output
    from .experiments import run_scenes

    set_threads(args.threads)
    setup = ScenesSetup(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    out = prepare_output(args.out, args.force)
    run_scenes(out, setup, command_line(args), configs=args.attention, ms=args.m, ks=args.k, force=args.force)
    print(f"wrote {out / 'report.md'}")
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    """``mita seg flops``: FLOPs of the whole Segmenter at 512 px, dense against MiTA m = k = 49."""
    from ..utils.machine import describe
    from ..vision.experiments import prepare_output
    from ..vision.flops import markdown_table
    from . import flops

    out = prepare_output(args.out, args.force) if args.out else None  # checked before the tables are computed
    rows = [flops.segmenter_row(s, counted=not args.no_counted) for s in flops.TABLE]
    best = max(r["reduction enc+dec (%)"] for r in rows)
    text = (
        f"## FLOPs of the whole Segmenter (ViT encoder + Mask Transformer, 2 blocks), {flops.IMAGE}x{flops.IMAGE}, "
        f"{flops.CLASSES} classes: softmax attention vs MiTA m = k = {flops.M} (batch 1, FLOPs = 2 x MACs)\n\n"
        + markdown_table(rows)
        + f"\nMeasured: up to {best:.1f}% fewer FLOPs with MiTA in encoder and decoder. "
        + f"The paper: {flops.PAPER_CLAIM}.\n"
    )
    print(text)
    if out is not None:
        import datetime

        from .experiments import write_csv

        write_report(out, "Segmenter FLOPs", args, text)
        write_csv(out / "flops.csv", rows, {"date": datetime.date.today().isoformat(), "machine": describe()})
        print(f"wrote {out / 'report.md'} and {out / 'flops.csv'}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from .experiments import ROBUSTNESS_K, ROBUSTNESS_M
    from .train import add_arguments

    seg = add_command_group(
        sub, "seg", "semantic segmentation: Segmenter on ADE20K and generated scenes, FLOPs", __doc__
    )

    p = seg.add_parser("train", help="train a Segmenter on ADE20K (resumable; DDP under torchrun)")
    add_out(p, "the run folder: config.json, metrics.csv, checkpoint.pt, model.safetensors, miou.json", required=True)
    add_arguments(p)
    p.set_defaults(func=cmd_train)

    p = seg.add_parser("eval", help="mIoU on ADE20K's validation split, optionally with another attention")
    p.add_argument("--data", required=True, help="ADEChallengeData2016, or the folder holding it")
    p.add_argument("--checkpoint", help="a 'mita seg train' run folder (its best.pt), a .pt or a .safetensors file")
    p.add_argument("--segmenter-checkpoint", help="a checkpoint of the Segmenter code (its {'model': ...} layout)")
    p.add_argument("--size", default="tiny", help="with --segmenter-checkpoint: the ViT size (default tiny)")
    p.add_argument("--decoder", default="mask_transformer", help="with --segmenter-checkpoint: the decoder")
    p.add_argument("--decoder-depth", type=int, default=2, help="with --segmenter-checkpoint: its blocks (default 2)")
    p.add_argument("--attention", help="evaluate with this encoder attention instead of the trained one (the swap)")
    p.add_argument("--decoder-attention", help="evaluate with this decoder attention")
    p.add_argument("--window", type=int, help="sliding-window size (default: the run's)")
    p.add_argument("--stride", type=int, help="sliding-window stride (default: the run's)")
    p.add_argument("--limit", type=int, help="the first this many validation images only")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    add_out(p, "also write the result as JSON to this file")
    add_force(p, "replace --out if it exists")
    p.set_defaults(func=cmd_eval)

    p = seg.add_parser("scenes", help="offline: SDPA vs MiTA on generated scenes, the swap, robustness over m, k")
    add_digits_arguments(p, "runs/seg/scenes", ScenesSetup())
    p.add_argument("--attention", nargs="+", help="swap configs (default: every registered method)")
    p.add_argument("--m", type=int, nargs="+", default=list(ROBUSTNESS_M), help="landmarks (squares)")
    p.add_argument("--k", type=int, nargs="+", default=list(ROBUSTNESS_K), help="keys per expert")
    p.set_defaults(func=cmd_scenes)

    add_flops_parser(
        seg, "FLOPs of the whole Segmenter at 512 px, dense vs MiTA m = k = 49", "also write report.md here", cmd_flops
    )
