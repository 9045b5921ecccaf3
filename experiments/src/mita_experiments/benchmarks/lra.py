"""``mita bench lra``: a Long Range Arena task's whole model against sequence length.

Each attention, length and mode is timed by :func:`mita_experiments.lra.train.speed`: the task's
classifier (the "model" section of its configuration) on random tokens, ``--warmup`` untimed
steps, then the median of ``--steps`` timed steps (CUDA synchronised).

* ``train``: forward, cross-entropy, backward and an AdamW step;
* ``infer``: a forward under ``torch.no_grad()`` in eval mode.
"""

from __future__ import annotations

import argparse

import torch

from mita import attention as registry

from ..lra.cli import add_config_arguments
from ..lra.config import check_model, load_config
from ..lra.train import speed
from ..utils.distributed import parse_device
from .bench import prepare_out_dir
from .models import add_common_arguments, check_at_least_one, write_results
from .report import command_line
from .timing import torch_threads

HELP = "a Long Range Arena task's whole model against sequence length: training steps or inference"
#: the modes of this command and :func:`~mita_experiments.lra.train.speed`'s names for them
MODES = {"train": "train", "infer": "eval"}
METHOD = (
    "The task's classifier with random weights on random tokens, {threads} torch threads, device {device}. "
    "For each attention, length and mode: {warmup} untimed step(s), then the median of {steps} timed steps. "
    "train: forward, cross-entropy, backward and an AdamW step; infer: a forward without gradients."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mita bench lra``."""
    add_config_arguments(p, data=False)
    p.add_argument("--methods", nargs="+", default=["sdpa", "mita"], metavar="CONFIG", help="attentions to time")
    p.add_argument("--lengths", type=int, nargs="+", required=True, metavar="N", help="sequence lengths")
    p.add_argument("--modes", nargs="+", default=["train"], choices=list(MODES), help="train: a step; infer: a forward")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point (their median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_common_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Every attention x mode x length; results.csv and results.md in ``--out``."""
    check_at_least_one(args, "batch", "steps")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if min(args.lengths) < 1:
        raise ValueError(f"--lengths must be >= 1, got {args.lengths}")
    for attention in args.methods:
        registry.resolve(attention)  # the registry's error names an unknown method or option
    parse_device(args.device)
    config = load_config(args.task, args.variant or "cpu", args.set, args.config)
    check_model(config["model"])
    with torch_threads(args.threads):
        out = prepare_out_dir(args.out, force=args.force, resume=False)
        rows = []
        timing = {"steps": args.steps, "warmup": args.warmup, "device": args.device}
        for attention in args.methods:
            for mode in dict.fromkeys(args.modes):
                for row in speed(args.task, config, attention, args.lengths, args.batch, mode=MODES[mode], **timing):
                    rows.append({"task": args.task, **row, "mode": mode})
                    print(f"{attention:<24} N={row['length']:>6} {mode:<5} {row['seconds_per_step'] * 1e3:10.2f} ms")
        method = METHOD.format(threads=torch.get_num_threads(), **timing)
        title = f"LRA {args.task}: the whole model against sequence length"
        report = write_results(out, rows, title, method, command_line(args))
    print(report.read_text())
    print(f"mita bench lra: results in {out}/ (results.csv, results.md)")
    return 0
