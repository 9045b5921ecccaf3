"""``mita lra generate|train|eval|speed``: Long Range Arena from the command line.

    mita lra generate --task listops --out data/listops
    mita lra train --task listops --data data/listops --attention mita --run-dir runs/listops-mita
    mita lra eval --task listops --data data/listops --checkpoint runs/listops-sdpa --attention mita
    mita lra speed --task listops --attention sdpa mita --lengths 1000 2000 --mode train

Configurations are named (``--variant lra|small|cpu``, files in ``mita/lra/configs``) and
changed with ``--set section.key=value``; ``torchrun --nproc_per_node N -m mita.cli lra train ...``
trains with DDP.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import sys
from pathlib import Path
from typing import Any

from .config import TASKS, load_config


def _options(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (values as Python literals when they parse)."""
    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"option {item!r} must read key=value, e.g. num_landmarks=128")
        try:
            out[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = text.strip()
    return out


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return load_config(args.task, args.variant, args.set, args.config)


def _data(args: argparse.Namespace, config: dict[str, Any]):
    from .data.loaders import load

    return load(args.task, args.data, **config["data"].get("loader", {}))


def _refuse_overwrite(path: Path | None, overwrite: bool) -> None:
    if path is not None and path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass --overwrite to replace it")


def cmd_generate(args: argparse.Namespace) -> int:
    config = _config(args)
    gen = dict(config["data"].get("generate") or {})
    if not gen:
        raise ValueError(f"task {args.task!r} has no generator: its data is downloaded (see docs/lra.md)")
    if args.task == "listops":
        from .data import listops

        paths = listops.generate(args.out, listops.ListOpsSpec(**gen), overwrite=args.overwrite)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    from .data import pathfinder

    num = gen.pop("num_samples")
    spec = pathfinder.PathfinderSpec(**gen)
    if args.grid:
        _refuse_overwrite(Path(args.grid), args.overwrite)
        print(pathfinder.example_grid(args.grid, spec))
    root = pathfinder.generate(args.out, spec, num, workers=args.workers, overwrite=args.overwrite, progress=True)
    print(root)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .train import init_distributed, train

    config = _config(args)
    ctx = init_distributed(args.device)
    data = _data(args, config)
    summary = train(
        config,
        data,
        args.run_dir,
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
    from .train import evaluate_checkpoint, init_distributed

    out = Path(args.out) if args.out else None
    _refuse_overwrite(out, args.overwrite)
    ctx = init_distributed(args.device)
    config = _config(args)
    result = evaluate_checkpoint(
        args.checkpoint,
        _data(args, config),
        attention=args.attention,
        options=_options(args.option),
        split=args.split,
        batch_size=args.batch_size,
        ctx=ctx,
    )
    if ctx.main:
        text = json.dumps(result, indent=2)
        print(text)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text + "\n")
    return 0


def cmd_speed(args: argparse.Namespace) -> int:
    from .data import listops
    from .train import speed

    out = Path(args.out) if args.out else None
    _refuse_overwrite(out, args.overwrite)
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
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


def _common(p: argparse.ArgumentParser, data: bool = True) -> None:
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--variant", default="cpu", help="named configuration: lra, small or cpu (default cpu)")
    p.add_argument("--config", help="a JSON configuration file instead of the packaged one")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one configuration value, e.g. train.steps=200 (repeatable)",
    )
    if data:
        p.add_argument("--data", required=True, help="folder of the task's files (see docs/lra.md)")
        p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")


def _guard(func):
    """Report a refused overwrite like the other input errors (exit status 2)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except FileExistsError as err:
            print(f"mita lra: error: {err}", file=sys.stderr)
            return 2

    return run


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
    g.add_argument("--out", required=True, help="output folder")
    g.add_argument("--grid", help="also write a PNG grid of examples here (Pathfinder)")
    g.add_argument("--workers", type=int, default=1, help="processes for Pathfinder (default 1)")
    g.add_argument("--overwrite", action="store_true", help="replace existing files")
    g.set_defaults(func=_guard(cmd_generate))

    t = lra.add_parser("train", help="train a model (resumable; DDP under torchrun)")
    _common(t)
    t.add_argument("--attention", default="sdpa", help="registered attention or config, e.g. 'mita:topk=32'")
    t.add_argument("--run-dir", required=True, help="folder for checkpoints and logs (never overwritten)")
    t.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    t.add_argument("--stop-after", type=int, help="stop (with a checkpoint) once this many steps are done")
    t.add_argument("--time-limit", type=float, help="stop (with a checkpoint) after this many seconds")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--no-tensorboard", action="store_true", help="CSV logs only")
    t.set_defaults(func=_guard(cmd_train))

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
    e.add_argument("--batch-size", type=int)
    e.add_argument("--out", help="also write the result as JSON here")
    e.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    e.set_defaults(func=_guard(cmd_eval))

    s = lra.add_parser("speed", help="time training steps or inference of the task's model against length")
    _common(s, data=False)
    s.add_argument("--attention", nargs="+", default=["sdpa", "mita"])
    s.add_argument("--lengths", type=int, nargs="+", required=True)
    s.add_argument("--mode", choices=["train", "eval"], default="train")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--steps", type=int, default=5, help="timed steps per length (after one warm-up)")
    s.add_argument("--device", help="cpu or cuda (default cpu)")
    s.add_argument("--out", help="also write the rows as CSV here")
    s.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    s.set_defaults(func=_guard(cmd_speed))
