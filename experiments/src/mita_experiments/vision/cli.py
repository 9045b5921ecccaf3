"""``mita vision``: FLOP tables, the digits experiments (swap, robustness, pruning) and the ImageNet
trainer. Whole-model speed is ``mita bench vit``."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from ..utils.files import atomic_write_text
from ..utils.flags import add_command_group, add_force, add_out
from .digits import DigitsSetup
from .experiments import ROBUSTNESS_K, ROBUSTNESS_M

_DIGITS_DEFAULTS = DigitsSetup()


def command_line(args: argparse.Namespace) -> str:
    """The command that produced a report, rebuilt from the parsed arguments."""
    sub = f"{args.command}_command"  # vision_command, video_command, ...
    parts = ["mita", args.command, getattr(args, sub)]
    for key, value in vars(args).items():
        if key in ("func", "command", sub) or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple)):
            parts.append(f"{flag} {' '.join(str(v) for v in value)}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def set_threads(threads: int | None) -> None:
    """torch's threads set to ``--threads`` (None: left as they are); a ValueError when it is below 1."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def digits_setup(args: argparse.Namespace, attention: str) -> DigitsSetup:
    """The setup of a digits command's flags (:func:`add_digits_arguments`) with ``attention``; sets ``--threads``."""
    set_threads(args.threads)
    return DigitsSetup(attention=attention, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)


def write_report(out: Path, title: str, args: argparse.Namespace, body: str) -> Path:
    """``out/report.md``: ``title``, the command of ``args``, the machine, then ``body``; its path."""
    from ..utils.machine import describe

    path = out / "report.md"
    atomic_write_text(path, f"# {title}\n\nCommand: `{command_line(args)}`\n\nMachine: {describe()}\n\n{body}")
    return path


def add_flops_parser(
    commands: argparse._SubParsersAction, help: str, out_help: str, func: Callable[[argparse.Namespace], int]
) -> None:
    """Add a ``flops`` command (``help``) with ``--out`` (``out_help``), ``--force`` and ``--no-counted``,
    run by ``func``."""
    p = commands.add_parser("flops", help=help)
    add_out(p, out_help, type=Path)
    add_force(p, "write into a non-empty --out (an existing report)")
    p.add_argument("--no-counted", action="store_true", help="skip counting the MiTA implementation itself")
    p.set_defaults(func=func)


def cmd_flops(args: argparse.Namespace) -> int:
    """``mita vision flops``: FLOP and parameter tables, full attention against MiTA."""
    from . import flops
    from .experiments import prepare_output

    out = prepare_output(args.out, args.force) if args.out else None  # checked before the tables are computed

    rows = [flops.backbone_row(b, counted=not args.no_counted) for b in flops.TABLE_BACKBONES]
    sweep = flops.length_sweep()
    vit5 = flops.vit5_rows()
    at512 = {r["model"]: r["reduction (%)"] for r in rows if r["N"] == 1025}
    claim = ", ".join(f"{name} {value:.1f}%" for name, value in at512.items())
    text = "\n".join(
        [
            "## FLOPs and parameters, full attention vs MiTA (batch 1, FLOPs = 2 x MACs)",
            "",
            flops.markdown_table(rows),
            f"Reduction at 512x512 (backbone only), measured: {claim}. The paper: {flops.PAPER_CLAIM}.",
            "",
            "## FLOPs against sequence length (ViT-S backbone, m = k = 49)",
            "",
            flops.markdown_table(sweep),
            "",
            "## ViT-5-S (CLS, patches, 4 registers at the end; RoPE) against MiTA-ViT-5-S (m = 25, k = 30)",
            "",
            flops.markdown_table(vit5),
        ]
    )
    print(text)
    if out is not None:
        from .experiments import pyplot

        lengths = [2**p for p in range(7, 17)]
        per_head = flops.method_flops_per_head(lengths)
        plt = pyplot()
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, values in per_head.items():
            ax1.loglog(lengths, values, marker=".", label=name)
        ax1.set(xlabel="sequence length N", ylabel="attention FLOPs per head (D = 64)", title="registry defaults")
        ax1.legend(fontsize=7)
        n = [r["N"] for r in sweep]
        ax2.plot(n, [r["full GFLOPs"] for r in sweep], marker="o", label="full attention")
        ax2.plot(n, [r["MiTA GFLOPs"] for r in sweep], marker="o", label="MiTA, m = k = 49")
        ax2.set(xlabel="tokens N (224 to 1024 px)", ylabel="GFLOPs", title="ViT-S backbone")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(out / "flops_vs_length.png", dpi=120)
        plt.close(fig)
        body = text + "\n![FLOPs against length](flops_vs_length.png)\n"
        print(f"wrote {write_report(out, 'FLOP tables', args, body)}")
    return 0


def cmd_swap(args: argparse.Namespace) -> int:
    """``mita vision swap``: train with SDPA, evaluate with every other attention."""
    from .experiments import prepare_output, run_swap

    out = prepare_output(args.out, args.force)
    run_swap(out, digits_setup(args, "sdpa"), args.attention, command_line(args), force=args.force)
    print(f"wrote {out / 'report.md'}")
    return 0


def cmd_robustness(args: argparse.Namespace) -> int:
    """``mita vision robustness``: MiTA trained with small m, k, evaluated with larger ones."""
    from .experiments import prepare_output, run_robustness

    out = prepare_output(args.out, args.force)
    run_robustness(
        out,
        digits_setup(args, args.train_attention),
        tuple(args.m),
        tuple(args.k),
        command_line(args),
        force=args.force,
    )
    print(f"wrote {out / 'report.md'}")
    return 0


def cmd_pruning(args: argparse.Namespace) -> int:
    """``mita vision pruning``: the tokens no MiTA expert selects, per layer."""
    from .experiments import prepare_output, run_pruning

    out = prepare_output(args.out, args.force)
    run_pruning(out, digits_setup(args, args.train_attention), command_line(args), force=args.force)
    print(f"wrote {out / 'report.md'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """``mita vision train``: the DeiT recipe on an ImageFolder tree (under torchrun: DDP)."""
    from .train import run

    run(args)
    return 0


def add_digits_arguments(p: argparse.ArgumentParser, out: str, defaults: DigitsSetup = _DIGITS_DEFAULTS) -> None:
    add_out(p, f"output folder (default {out})", default=Path(out), type=Path)
    add_force(
        p, "write into a non-empty --out, training its models over (without it, an interrupted run there resumes)"
    )
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--threads", type=int, help="torch threads (1 is fastest on a busy machine)")


def _add_train_parser(vision: argparse._SubParsersAction) -> None:
    from .train import add_arguments

    p = vision.add_parser(
        "train",
        help="train a (MiTA-)DeiT on an ImageFolder tree (DDP: torchrun -m mita_experiments vision train)",
        description="The DeiT recipe on the shared trainer; see mita_experiments.vision.train.",
    )
    add_out(p, "the run folder: config.json, metrics.csv, checkpoint.pt, model.safetensors, ...", required=True)
    add_arguments(p)
    p.set_defaults(func=cmd_train)


def add_parser(sub: argparse._SubParsersAction) -> None:
    vision = add_command_group(
        sub, "vision", "ViTs with MiTA: FLOP tables, digits experiments, ImageNet trainer", __doc__
    )

    add_flops_parser(
        vision,
        "FLOP and parameter tables, full attention vs MiTA",
        "also write report.md and flops_vs_length.png here",
        cmd_flops,
    )

    p = vision.add_parser("swap", help="train with SDPA, evaluate with MiTA and the other methods")
    add_digits_arguments(p, "runs/vision/swap")
    p.add_argument("--attention", nargs="+", help="configs to evaluate (default: every registered method)")
    p.set_defaults(func=cmd_swap)

    p = vision.add_parser("robustness", help="train MiTA with small m, k; evaluate on a grid of larger m, k")
    add_digits_arguments(p, "runs/vision/robustness")
    p.add_argument("--train-attention", default="mita:num_landmarks=4,topk=4", help="the MiTA config trained")
    p.add_argument("--m", type=int, nargs="+", default=list(ROBUSTNESS_M), help="landmarks (squares)")
    p.add_argument("--k", type=int, nargs="+", default=list(ROBUSTNESS_K), help="keys per expert")
    p.set_defaults(func=cmd_robustness)

    p = vision.add_parser("pruning", help="tokens no MiTA expert selects, per layer, and heat maps")
    add_digits_arguments(p, "runs/vision/pruning")
    p.add_argument("--train-attention", default="mita:num_landmarks=16,topk=16", help="the MiTA config trained")
    p.set_defaults(func=cmd_pruning)

    _add_train_parser(vision)
