"""The flags of every command that trains in a run folder, spelled one way."""

from __future__ import annotations

import argparse
from typing import Any

from ..utils.flags import add_force

__all__ = ["add_arguments", "options", "positive_int"]


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --resume, --force, --stop-after, --time-limit, --no-progress, --no-tensorboard and --device."""
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its checkpoint, with its own configuration and attention "
        "(what may change on resume: see the command's description)",
    )
    add_force(parser, "start over in an --out that holds a run or other files (run files replaced, others kept)")
    parser.add_argument(
        "--stop-after", type=positive_int, help="stop (with a checkpoint) once this many steps are done"
    )
    parser.add_argument("--time-limit", type=_positive_float, help="stop (with a checkpoint) after this many seconds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-tensorboard", action="store_true", help="CSV and JSONL logs only")
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`~mita_experiments.trainer.train` that :func:`add_arguments` gives
    (all but ``ctx``: pass ``init_distributed(args.device)``)."""
    return {
        "resume": args.resume,
        "force": args.force,
        "stop_after": args.stop_after,
        "time_limit": args.time_limit,
        "progress": not args.no_progress,
        "tensorboard": not args.no_tensorboard,
    }
