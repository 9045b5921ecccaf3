"""``mita lra generate|train|eval``: Long Range Arena from the command line.

    mita lra generate --task listops --out data/listops
    mita lra train --task listops --data data/listops --attention mita --out runs/listops-mita
    mita lra eval --task listops --data data/listops --checkpoint runs/listops-sdpa --attention mita

Configurations are named (``--variant lra|small|cpu``, files in ``mita_experiments/lra/configs``)
and changed with ``--set section.key=value`` (nested: ``--set data.generate.num_train=2000``);
``--out`` names the output (a folder for ``generate`` and ``train``, a file for ``eval``) and
``--force`` lets it be overwritten; ``torchrun --nproc_per_node N -m mita_experiments lra train ...``
trains with DDP. Timing a task's model against length is ``mita bench`` (it calls
:func:`mita_experiments.lra.train.speed`).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mita.utils.options import parse_assignments

from ..trainer import cli as trainer_cli
from ..utils.files import atomic_write_text, check_output_file, prepare_output_dir
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
    spec = _spec(pathfinder.PathfinderSpec, gen, extra=["num_samples"])
    prepare_output_dir(args.out, reuse=True)
    if grid is not None:
        print(pathfinder.example_grid(grid, spec))
    root = pathfinder.generate(args.out, spec, num, workers=args.workers, overwrite=args.force, progress=True)
    print(root)
    return 0


def _spec(cls: type, options: dict[str, Any], extra: list[str] | None = None) -> Any:
    """``cls(**options)``, a ValueError naming the unknown keys of ``data.generate`` (valid: the
    fields of ``cls`` and the ``extra`` keys the command itself reads)."""
    import dataclasses

    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"data.generate: unknown key(s) {unknown}; valid: {sorted([*fields, *(extra or [])])}")
    return cls(**options)


def cmd_train(args: argparse.Namespace) -> int:
    """``mita lra train``: train (or ``--resume``, or ``--force`` start over) a run in ``--out``."""
    from ..utils.distributed import init_distributed
    from .train import resume_config, train

    if args.resume and args.variant is None and args.config is None:
        config = resume_config(args.out, args.set)  # the run's own configuration, with --set applied
    else:
        config = _config(args)
    ctx = init_distributed(args.device)
    summary = train(config, _data(args, config), args.out, args.attention, ctx=ctx, **trainer_cli.options(args))
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


def _positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value


def add_config_arguments(p: argparse.ArgumentParser, data: bool = True) -> None:
    """The LRA configuration flags (--task, --variant, --config, --set; --data if ``data``); ``mita bench lra`` too."""
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lra",
        help="Long Range Arena: generate data, train, evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lra = p.add_subparsers(dest="lra_command", required=True, metavar="SUBCOMMAND")

    g = lra.add_parser("generate", help="write generated ListOps / Pathfinder / Path-X data in the LRA layout")
    add_config_arguments(g, data=False)
    add_out(g, "output folder", required=True)
    g.add_argument("--grid", help="also write a PNG grid of examples here (Pathfinder)")
    g.add_argument("--workers", type=_positive_int, default=1, help="processes for Pathfinder (default 1)")
    add_force(g, "write into a non-empty --out, replacing its files")
    g.set_defaults(func=cmd_generate)

    t = lra.add_parser("train", help="train a model (resumable; DDP under torchrun)")
    add_config_arguments(t)
    t.add_argument(
        "--attention", help="registered attention or config, e.g. 'mita:topk=32' (default: sdpa; on --resume the run's)"
    )
    add_out(t, "run folder for checkpoints and logs (replaced only with --force)", required=True)
    trainer_cli.add_arguments(t)
    t.set_defaults(func=cmd_train)

    e = lra.add_parser("eval", help="evaluate a checkpoint, optionally with another attention or m, k, s")
    add_config_arguments(e)
    e.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    e.add_argument("--checkpoint", required=True, help="a run folder (its best.pt), a .pt or a model.safetensors file")
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
    add_force(e, "replace --out if it exists")
    e.set_defaults(func=cmd_eval)
