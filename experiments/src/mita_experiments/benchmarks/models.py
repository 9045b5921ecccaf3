"""What the whole-model targets of ``mita bench`` (``vit``, ``video``, ``lra``) share.

Each checks its arguments and then its ``--out`` folder (default: a new
``bench-results/<date-time>``; a non-empty one needs ``--force``) before any work, and writes
there ``results.csv`` (one row per measurement, each with the machine line) and
``results.md`` (the command, the machine, how it was measured, the table). Variants of a
model are timed side by side by :func:`side_by_side`.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..utils.files import atomic_write, atomic_write_text
from ..utils.flags import add_force, add_out
from ..utils.machine import describe
from ..vision.flops import markdown_table
from .timing import alternating_rounds

REPORT, CSV = "results.md", "results.csv"

#: a progress callback of :func:`~mita_experiments.benchmarks.timing.alternating_rounds`
OnRound = Callable[[int, dict[str, float]], None]


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """``--threads``, ``--out`` and ``--force``, as every target spells them."""
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")
    add_out(p, "output folder for results.csv and results.md (default: bench-results/<date-time>)")
    add_force(p, "write into a non-empty --out (its results are replaced)")


def check_at_least_one(args: argparse.Namespace, *names: str) -> None:
    """A ValueError naming the first flag of ``names`` whose value is below 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def side_by_side(
    calls: dict[str, Callable[[], torch.Tensor]], rounds: int, baseline: str, on_round: OnRound | None = None
) -> dict[str, dict[str, Any]]:
    """Each call timed in ``rounds`` alternating rounds after one warm-up call each
    (:func:`~mita_experiments.benchmarks.timing.alternating_rounds`): per call its median seconds,
    its speed-up over the call ``baseline`` and whether its (warm-up) output is finite."""
    measured = alternating_rounds(calls, rounds, on_round=on_round)
    base = measured.median(baseline)
    return {
        name: {
            "median": measured.median(name),
            "speed-up": base / measured.median(name),
            "finite": bool(torch.isfinite(measured.outputs[name]).all()),
        }
        for name in calls
    }


def progress(total: int, desc: str) -> tuple[Any, OnRound]:
    """A progress bar over ``total`` timed rounds and the ``on_round`` callback that advances it."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="round", dynamic_ncols=True)

    def advance(_: int, seconds: dict[str, float]) -> None:
        bar.set_postfix({name: f"{t:.3g} s" for name, t in seconds.items()})
        bar.update()

    return bar, advance


def _cell(value: Any) -> Any:
    """A table cell: floats to 3 significant digits, trailing zeros kept (whole numbers from 100 up)."""
    if isinstance(value, float):
        return f"{value:#.3g}".rstrip(".") if abs(value) < 100 else f"{value:,.0f}"
    return value


def write_results(out: Path, rows: Sequence[dict[str, Any]], title: str, method: str, command: str) -> Path:
    """``out/results.csv`` (the rows, each with the machine line) and ``out/results.md`` (``title``,
    the command, the machine, ``method``: how it was measured, the table), written atomically;
    returns the path of results.md."""
    machine = describe()
    with atomic_write(out / CSV, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "machine"])
        writer.writeheader()
        writer.writerows({**row, "machine": machine} for row in rows)
    table = markdown_table([{k: _cell(v) for k, v in row.items()} for row in rows])
    text = f"# {title}\n\nCommand: `{command}`\n\nMachine: {machine}\n\n{method}\n\n{table}"
    atomic_write_text(out / REPORT, text)
    return out / REPORT
