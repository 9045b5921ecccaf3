"""``mita lra generate|train|eval|speed``: Long Range Arena from the command line.

    mita lra generate --task listops --out data/listops
    mita lra train --task listops --data data/listops --attention mita --out runs/listops-mita
    mita lra eval --task listops --data data/listops --checkpoint runs/listops-sdpa --attention mita
    mita lra speed --task listops --attention sdpa mita --lengths 1000 2000 --mode train

Configurations are named (``--variant lra|small|cpu``, files in ``mita/lra/configs``) and
changed with ``--set section.key=value`` (nested: ``--set data.generate.num_train=2000``);
``--out`` names the output (a folder for ``generate`` and ``train``, a file for ``eval`` and
``speed``) and ``--force`` lets it be overwritten; ``torchrun --nproc_per_node N -m mita.cli lra train ...``
trains with DDP.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable
from typing import Any

from mita.utils.options import parse_assignments

from ..utils.files import atomic_write, atomic_write_text, check_output_file, prepare_output_dir
from ..utils.flags import add_force, add_out
from .config import TASKS, load_config


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return load_config(args.task, args.variant or "cpu", args.set, args.config)


def _data(args: argparse.Namespace, config: dict[str, Any]):
    from .data.loaders import load

    return load(args.task, args.data, **config["data"].get("loader", {}))


def cmd_generate(args: argparse.Namespace) -> int:
    """``mita lra generate``: ListOps or Pathfinder / Path-X files in the LRA layout."""
    config = _config(args)
    gen = dict(config["data"].get("generate") or {})
    if not gen:
        raise ValueError(f"task {args.task!r} has no generator: its data is downloaded (see docs/lra.md)")
    grid = check_output_file(args.grid, force=args.force, flag="--grid") if args.grid else None
    if args.task == "listops":
        from .data import listops

        spec = _spec(listops.ListOpsSpec, gen)
        prepare_output_dir(args.out, reuse=True)  # the generator refuses its own existing files
        paths = listops.generate(args.out, spec, overwrite=args.force)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    from .data import pathfinder

    num = gen.pop("num_samples", 20_000)
    spec = _spec(pathfinder.PathfinderSpec, gen)
    prepare_output_dir(args.out, reuse=True)
    if grid is not None:
        print(pathfinder.example_grid(grid, spec))
    root = pathfinder.generate(args.out, spec, num, workers=args.workers, overwrite=args.force, progress=True)
    print(root)
    return 0


def _spec(cls: type, options: dict[str, Any]) -> Any:
    """``cls(**options)``, a ValueError naming the unknown keys of ``data.generate``."""
    import dataclasses

    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"data.generate: unknown key(s) {unknown}; valid: {valid}")
    return cls(**options)


def cmd_train(args: argparse.Namespace) -> int:
    """``mita lra train``: train (or ``--resume``) a run in ``--out``."""
    from .train import resume_config

    if args.resume and args.variant is None and args.config is None:
        config = resume_config(args.out, args.set)  # the run's own configuration, with --set applied
    else:
        config = _config(args)
    return train_with(args, config, lambda: _data(args, config))


def train_with(args: argparse.Namespace, config: dict[str, Any], data: Callable[[], Any]) -> int:
    """Train ``config`` on ``data()`` with the training flags of ``args`` (shared by lra and recall)."""
    from ..utils.distributed import init_distributed
    from .train import train

    ctx = init_distributed(args.device)
    summary = train(
        config,
        data(),
        args.out,
        attention=args.attention,
        resume=args.resume,
        stop_after=args.stop_after,
        time_limit=args.time_limit,
        progress=not args.no_progress,
        tensorboard=not args.no_tensorboard,
        ctx=ctx,
    )
    if ctx.main:
        print(json.dumps(summary, indent=2))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``mita lra eval``: a checkpoint's accuracy, optionally with another attention or m, k, s."""
    from ..utils.distributed import init_distributed
    from .train import evaluate_checkpoint

    out = check_output_file(args.out, force=args.force) if args.out else None
    options = parse_assignments(args.option, "--option")
    ctx = init_distributed(args.device)
    config = _config(args)
    result = evaluate_checkpoint(
        args.checkpoint,
        _data(args, config),
        attention=args.attention,
        options=options,
        split=args.split,
        batch_size=args.batch_size,
        ctx=ctx,
    )
    if ctx.main:
        text = json.dumps(result, indent=2)
        print(text)
        if out is not None:
            atomic_write_text(out, text + "\n")
    return 0


def cmd_speed(args: argparse.Namespace) -> int:
    """``mita lra speed``: training step time or inference throughput against length."""
    from .data import listops
    from .train import speed

    out = check_output_file(args.out, force=args.force) if args.out else None
    config = _config(args)
    classes = {"listops": 10, "image": 10}.get(args.task, 2)
    meta = {
        "vocab_size": len(listops.VOCAB) if args.task == "listops" else 257,
        "num_classes": classes,
        "max_length": max(args.lengths),
        "dual": args.task == "retrieval",
    }
    rows = []
    for attention in args.attention:
        for row in speed(
            config,
            meta,
            attention,
            args.lengths,
            args.batch_size,
            args.steps,
            mode=args.mode,
            device=args.device or "cpu",
        ):
            print(json.dumps(row))
            rows.append(row)
    if out is not None:
        with atomic_write(out, "w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def _positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def _common(p: argparse.ArgumentParser, data: bool = True) -> None:
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--variant", help="named configuration: lra, small or cpu (default cpu; on --resume the run's)")
    p.add_argument("--config", help="a JSON configuration file instead of the packaged one")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one configuration value, e.g. train.steps=200 or data.generate.num_train=2000 (repeatable)",
    )
    if data:
        p.add_argument("--data", required=True, help="folder of the task's files (see docs/lra.md)")
        p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """The flags :func:`train_with` reads besides ``--out`` and ``--device`` (shared by lra and recall)."""
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its checkpoint (steps and eval/checkpoint cadence may change)",
    )
    p.add_argument("--stop-after", type=_positive_int, help="stop (with a checkpoint) once this many steps are done")
    p.add_argument("--time-limit", type=float, help="stop (with a checkpoint) after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-tensorboard", action="store_true", help="CSV logs only")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lra",
        help="Long Range Arena: generate data, train, evaluate, time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lra = p.add_subparsers(dest="lra_command", required=True, metavar="SUBCOMMAND")

    g = lra.add_parser("generate", help="write generated ListOps / Pathfinder / Path-X data in the LRA layout")
    _common(g, data=False)
    add_out(g, "output folder", required=True)
    g.add_argument("--grid", help="also write a PNG grid of examples here (Pathfinder)")
    g.add_argument("--workers", type=_positive_int, default=1, help="processes for Pathfinder (default 1)")
    add_force(g, "write into a non-empty --out, replacing its files", deprecated=["--overwrite"])
    g.set_defaults(func=cmd_generate)

    t = lra.add_parser("train", help="train a model (resumable; DDP under torchrun)")
    _common(t)
    t.add_argument("--attention", help="registered attention or config, e.g. 'mita:topk=32' (default sdpa)")
    add_out(t, "run folder for checkpoints and logs (never overwritten)", required=True, deprecated=["--run-dir"])
    add_training_arguments(t)
    t.set_defaults(func=cmd_train)

    e = lra.add_parser("eval", help="evaluate a checkpoint, optionally with another attention or m, k, s")
    _common(e)
    e.add_argument("--checkpoint", required=True, help="a run folder (its best.pt) or a .pt file")
    e.add_argument("--attention", help="evaluate with this attention instead of the trained one (swap)")
    e.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="attention option at evaluation, e.g. num_landmarks=128 (repeatable)",
    )
    e.add_argument("--split", default="test", choices=["train", "val", "test"])
    e.add_argument("--batch-size", type=_positive_int)
    add_out(e, "also write the result as JSON to this file")
    add_force(e, "replace --out if it exists", deprecated=["--overwrite"])
    e.set_defaults(func=cmd_eval)

    s = lra.add_parser("speed", help="time training steps or inference of the task's model against length")
    _common(s, data=False)
    s.add_argument("--attention", nargs="+", default=["sdpa", "mita"])
    s.add_argument("--lengths", type=_positive_int, nargs="+", required=True)
    s.add_argument("--mode", choices=["train", "eval"], default="train")
    s.add_argument("--batch-size", type=_positive_int, default=8)
    s.add_argument("--steps", type=_positive_int, default=5, help="timed steps per length (after one warm-up)")
    s.add_argument("--device", help="cpu or cuda (default cpu)")
    add_out(s, "also write the rows as CSV to this file")
    add_force(s, "replace --out if it exists", deprecated=["--overwrite"])
    s.set_defaults(func=cmd_speed)
