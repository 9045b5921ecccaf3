"""``mita recall generate|train|eval|sweep|report``: multi-query associative recall (spec section 9).

    mita recall generate --out data/recall --set data.seq_len=512 --set data.num_pairs=32
    mita recall train --out runs/recall-sdpa --attention sdpa --set data.num_pairs=32
    mita recall eval --checkpoint runs/recall-sdpa --attention "mita:num_landmarks=32,topk=32"
    mita recall sweep --out runs/sweep --methods sdpa mita linear --lengths 512 --pairs 8 32 128
    mita recall report --out runs/sweep

The configuration (``mita/recall/configs/recall.json``: data, model, train) is changed with
``--set section.key=value``; without ``--data`` the data is generated from ``data.seed``.
``--resume`` continues a run with its own configuration and attention (``--set`` may change
train.steps and the cadences); ``torchrun --nproc_per_node N -m mita_experiments recall train ...``
trains with DDP.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..trainer import cli as trainer_cli
from ..utils.flags import add_command_group, add_force, add_out

EVAL_FIELDS = ["checkpoint", "step", "trained_with", "attention", "options", "split", "accuracy", "loss"]


def cmd_generate(args: argparse.Namespace) -> int:
    from . import data, task

    cfg = task.config(overrides=args.set, path=args.config)["data"]
    sizes = {name: int(cfg[f"num_{name}"]) for name in data.SPLITS}
    print(data.save(args.out, task.spec_of(cfg), sizes, int(cfg["seed"]), overwrite=args.force))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from .. import trainer
    from ..lra.config import apply_overrides
    from . import task

    if args.resume and args.config is None and (Path(args.out) / trainer.MANIFEST).is_file():
        cfg = apply_overrides(trainer.read_manifest(args.out)["config"], args.set)  # the run's own
        task.check_data(cfg["data"])
    else:
        cfg = task.config(overrides=args.set, path=args.config)
    return trainer_cli.run_train(args, task.train, cfg, task.task_data(cfg["data"], args.data))


def cmd_eval(args: argparse.Namespace) -> int:
    from . import sweep, task

    result = trainer_cli.run_eval(
        args,
        lambda checkpoint, **common: task.evaluate_checkpoint(
            checkpoint, args.data, diagnostics=args.diagnostics, **common
        ),
    )
    if result is not None and args.csv:
        row = {k: result[k] for k in EVAL_FIELDS}
        row["options"] = json.dumps(row["options"])
        sweep.append_row(Path(args.csv), row, EVAL_FIELDS)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from . import sweep

    cells = sweep.grid(args.methods, args.lengths, args.pairs, args.ratio, args.seeds)
    for cell in cells:  # fail on a bad override, at any cell's N, before the first run
        sweep.cell_config(cell, args.set or [], args.batch_tokens)
    for row in sweep.sweep(cells, args.out, args.set, args.batch_tokens, progress=not args.no_progress):
        print(json.dumps(row), flush=True)
    for path in sweep.plot(args.out):
        print(path)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from . import sweep

    rows = sweep.read_results(args.out)
    if not rows:
        raise FileNotFoundError(f"no {sweep.RESULTS} with rows in {args.out}; run `mita recall sweep` first")
    print(sweep.table(rows))
    for path in sweep.plot(args.out, rows):
        print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    rc = add_command_group(
        sub, "recall", "associative recall: generate, train, evaluate, sweep methods x N x P", __doc__
    )

    g = rc.add_parser("generate", help="write train/val/test .npz files and meta.json")
    trainer_cli.add_overrides(g, "data.num_pairs=64")
    add_out(g, "output folder", required=True)
    add_force(g, "replace the files of an earlier generate in --out")
    g.set_defaults(func=cmd_generate)

    t = rc.add_parser("train", help="train a model (resumable; DDP under torchrun)")
    trainer_cli.add_overrides(t, "data.num_pairs=64")
    t.add_argument("--data", help="a folder written by `mita recall generate` (default: generate from the config)")
    trainer_cli.add_train_arguments(t)
    t.set_defaults(func=cmd_train)

    e = rc.add_parser("eval", help="evaluate a run, optionally with another attention or MiTA m, k, s")
    trainer_cli.add_eval_arguments(e, "num_landmarks=64")
    e.add_argument("--data", help="a folder written by `mita recall generate` (default: the run's own data)")
    e.add_argument("--csv", help="append the result as one row to this CSV (created with a header)")
    e.add_argument(
        "--diagnostics",
        action="store_true",
        help="also measure MiTA's routing diagnostics per layer and head (printed and in --out, not in --csv)",
    )
    e.set_defaults(func=cmd_eval)

    s = rc.add_parser("sweep", help="train a grid of methods x N x P (resumes; one CSV row per run) and plot it")
    add_out(s, "sweep folder: results.csv, runs/, plots (continued if it exists)", required=True)
    s.add_argument("--methods", nargs="+", required=True, help="attention configs, e.g. sdpa 'mita:topk=32'")
    s.add_argument("--lengths", type=int, nargs="+", required=True, help="sequence lengths N")
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument("--pairs", type=int, nargs="+", help="numbers of pairs P (crossed with --lengths)")
    group.add_argument("--ratio", type=float, help="P = round(ratio * N) at each N")
    s.add_argument("--seeds", type=int, nargs="+", default=[0], help="data and training seeds (default 0)")
    trainer_cli.add_overrides(s, "train.steps=500", file=False, what="a configuration value of every run")
    s.add_argument(
        "--batch-tokens",
        type=int,
        help="batch = min(train.batch_size, this // N) sequences: the same tokens per step at every N",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_sweep)

    r = rc.add_parser("report", help="a sweep's results as a Markdown table, and its plots (again)")
    add_out(r, "the sweep folder", required=True)
    r.set_defaults(func=cmd_report)
