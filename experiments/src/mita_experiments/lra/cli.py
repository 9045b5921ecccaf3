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
from typing import Any

from ..trainer import cli as trainer_cli
from ..utils.files import check_output_file, prepare_output_dir
from ..utils.flags import add_command_group, add_force, add_out
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
    from .train import resume_config, train

    if args.resume and args.variant is None and args.config is None:
        config = resume_config(args.out, args.set)  # the run's own configuration, with --set applied
    else:
        config = _config(args)
    return trainer_cli.run_train(args, train, config, _data(args, config))


def cmd_eval(args: argparse.Namespace) -> int:
    """``mita lra eval``: a checkpoint's accuracy, optionally with another attention or m, k, s."""
    from .train import evaluate_checkpoint

    config = _config(args)
    trainer_cli.run_eval(
        args, lambda checkpoint, **common: evaluate_checkpoint(checkpoint, _data(args, config), **common)
    )
    return 0


def add_config_arguments(p: argparse.ArgumentParser, data: bool = True) -> None:
    """The LRA configuration flags (--task, --variant, --config, --set; --data if ``data``); ``mita bench lra`` too."""
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--variant", help="named configuration: lra, small or cpu (default cpu; on --resume the run's)")
    trainer_cli.add_overrides(p, "train.steps=200 or data.generate.num_train=2000")
    if data:
        p.add_argument("--data", required=True, help="folder of the task's files (see docs/lra.md)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    lra = add_command_group(sub, "lra", "Long Range Arena: generate data, train, evaluate", __doc__)

    g = lra.add_parser("generate", help="write generated ListOps / Pathfinder / Path-X data in the LRA layout")
    add_config_arguments(g, data=False)
    add_out(g, "output folder", required=True)
    g.add_argument("--grid", help="also write a PNG grid of examples here (Pathfinder)")
    g.add_argument("--workers", type=trainer_cli.positive_int, default=1, help="processes for Pathfinder (default 1)")
    add_force(g, "write into a non-empty --out, replacing its files")
    g.set_defaults(func=cmd_generate)

    t = lra.add_parser("train", help="train a model (resumable; DDP under torchrun)")
    add_config_arguments(t)
    trainer_cli.add_train_arguments(t)
    t.set_defaults(func=cmd_train)

    e = lra.add_parser("eval", help="evaluate a checkpoint, optionally with another attention or m, k, s")
    add_config_arguments(e)
    trainer_cli.add_eval_arguments(e, "num_landmarks=128")
    e.set_defaults(func=cmd_eval)
