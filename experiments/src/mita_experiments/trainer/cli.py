"""The flags of every command that trains in a run folder, spelled one way."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mita.utils.options import parse_assignments

from ..utils.files import atomic_write_text, check_output_file
from ..utils.flags import add_force, add_out

__all__ = [
    "add_arguments",
    "add_eval_arguments",
    "add_overrides",
    "add_recipe_arguments",
    "add_train_arguments",
    "flag",
    "options",
    "positive_int",
    "resumed_recipe",
    "run_eval",
    "run_recipe",
    "run_train",
]


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
    (all but ``ctx``: pass the one ``distributed(args.device)`` gives)."""
    return {
        "resume": args.resume,
        "force": args.force,
        "stop_after": args.stop_after,
        "time_limit": args.time_limit,
        "progress": not args.no_progress,
        "tensorboard": not args.no_tensorboard,
    }


def _add_assignments(parser: argparse.ArgumentParser, flag: str, metavar: str, help: str) -> None:
    """A repeatable ``flag KEY=VALUE`` collected into a list (parsed later by the command)."""
    parser.add_argument(flag, action="append", default=[], metavar=metavar, help=f"{help} (repeatable)")


def add_overrides(
    parser: argparse.ArgumentParser, example: str, *, file: bool = True, what: str = "one configuration value"
) -> None:
    """Add ``--set SECTION.KEY=VALUE`` (repeatable; its help: "override ``what``, e.g. ``example``") and,
    if ``file``, ``--config`` (a JSON configuration file instead of the packaged one)."""
    if file:
        parser.add_argument("--config", help="a JSON configuration file instead of the packaged one")
    _add_assignments(parser, "--set", "SECTION.KEY=VALUE", f"override {what}, e.g. {example}")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a ``train`` command's --attention and --out (the run folder), then :func:`add_arguments`."""
    parser.add_argument(
        "--attention", help="registered attention or config, e.g. 'mita:topk=32' (default: sdpa; on --resume the run's)"
    )
    add_out(parser, "run folder for checkpoints and logs (replaced only with --force)", required=True)
    add_arguments(parser)


def run_train(args: argparse.Namespace, train: Callable[..., Mapping[str, Any]], config: Any, data: Any) -> int:
    """``train(config, data, args.out, args.attention, ctx=..., **options(args))`` on this process (under
    torchrun: its rank of a DDP run); the main process prints the summary as JSON."""
    from ..utils.distributed import distributed

    with distributed(args.device) as ctx:
        summary = train(config, data, args.out, args.attention, ctx=ctx, **options(args))
    if ctx.main:
        print(json.dumps(summary, indent=2))
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser, option_example: str) -> None:
    """Add an ``eval`` command's --checkpoint, --attention, --option (``option_example`` in its help),
    --split, --batch-size, --device, --out and --force."""
    parser.add_argument(
        "--checkpoint", required=True, help="a run folder (its best.pt), a .pt or a model.safetensors file"
    )
    parser.add_argument("--attention", help="evaluate with this attention instead of the trained one (swap)")
    _add_assignments(parser, "--option", "KEY=VALUE", f"attention option at evaluation, e.g. {option_example}")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--batch-size", type=positive_int)
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    add_out(parser, "also write the result as JSON to this file")
    add_force(parser, "replace --out if it exists")


def run_eval(args: argparse.Namespace, evaluate: Callable[..., dict[str, Any]]) -> dict[str, Any] | None:
    """Run an ``eval`` command: --out and --option are checked first, then ``evaluate(args.checkpoint,
    attention=, options=, split=, batch_size=, ctx=)`` runs on this process. The main process prints the
    result as JSON (and writes it to --out) and returns it; the other ranks return None."""
    from ..utils.distributed import distributed

    out = check_output_file(args.out, force=args.force) if args.out else None
    opts = parse_assignments(args.option, "--option")
    with distributed(args.device) as ctx:
        result = evaluate(
            args.checkpoint,
            attention=args.attention,
            options=opts,
            split=args.split,
            batch_size=args.batch_size,
            ctx=ctx,
        )
    if not ctx.main:
        return None
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        atomic_write_text(out, text + "\n")
    return result


def flag(key: str) -> str:
    """The command-line flag of a recipe key: ``batch_size`` -> ``--batch-size``."""
    return "--" + key.replace("_", "-")


def add_recipe_arguments(
    parser: argparse.ArgumentParser,
    data: str,
    recipe: Mapping[str, Any],
    helps: Mapping[str, str],
    workers: int,
    shown: Mapping[str, str] | None = None,
) -> None:
    """Add ``--data``, a flag per key of a training command's ``recipe`` (its defaults), ``--workers`` and
    :func:`add_arguments`.

    A flag left out is None (the recipe's default, or on ``--resume`` the run's); a bool key is a store-true
    flag, any other takes its default's type (str where the default is None or a dict).

    Args:
        parser (ArgumentParser): the command's parser.
        data (str): the help of ``--data`` (required), where the data set is.
        recipe (mapping): key -> default, in the order the flags are listed.
        helps (mapping): key -> its help (the default and "on --resume the run's" are appended).
        workers (int): ``--workers``' default, the data loading processes per process.
        shown (mapping | None): key -> how its default is shown in the help (default: the value).
    """
    parser.add_argument("--data", required=True, help=data)
    for key, default in recipe.items():
        text = f"{helps[key]} (default {(shown or {}).get(key, default)}; on --resume the run's)"
        if isinstance(default, bool):
            parser.add_argument(flag(key), action="store_true", default=None, help=text)
        else:
            kind = str if default is None or isinstance(default, dict) else type(default)
            parser.add_argument(flag(key), type=kind, help=text)
    parser.add_argument(
        "--workers", type=int, default=workers, help=f"image loading processes per process (default {workers})"
    )
    add_arguments(parser)


def resumed_recipe(out: Path, keys: Mapping[str, Any], command: str) -> dict[str, Any] | None:
    """On ``--resume``, the recipe recorded by the run in ``out`` (None if it holds no run yet); a ValueError
    when that run was not made by ``command`` (its recipe lacks a key of ``keys`` or has another)."""
    from .run import MANIFEST, read_manifest

    if not (out / MANIFEST).is_file():
        return None
    run = read_manifest(out)["config"].get("recipe")
    if not isinstance(run, dict) or set(run) != set(keys):
        raise ValueError(f"--resume: {out} holds a run that is not a '{command}' run; pick its own command")
    return run


def run_recipe(
    args: argparse.Namespace,
    made: dict[str, Any],
    training: Callable[[dict[str, Any], Path, int, int], tuple[Any, dict[str, Any]]],
    finish: Callable[[dict[str, Any], Any], None] | None = None,
) -> dict[str, Any]:
    """Train a checked recipe ``made`` in ``--out`` on this process (under torchrun: its rank of a DDP run).

    Args:
        args (Namespace): the flags of :func:`add_recipe_arguments` with ``--data`` and ``--out``.
        made (dict): the recipe.
        training (callable): (recipe, data folder, ``--workers``, processes) -> the trainer's task and config.
        finish (callable | None): (summary, distributed context) -> None, run on every process after training
            and before the process group is closed (e.g. a final evaluation that adds to the summary).

    Returns:
        The trainer's summary, which the main process also prints as JSON.
    """
    from ..utils.distributed import distributed
    from .loop import train

    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    with distributed(args.device) as ctx:
        task, config = training(made, Path(args.data), args.workers, ctx.world)
        summary = train(task, config, args.out, ctx=ctx, **options(args))
        if finish is not None:
            finish(summary, ctx)
    if ctx.main:
        print(json.dumps(summary, indent=2))
    return summary
