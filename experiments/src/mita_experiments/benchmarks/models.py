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
from .bench import prepare_out_dir
from .report import command_line
from .timing import alternating_rounds, torch_threads

REPORT, CSV = "results.md", "results.csv"

#: a progress callback of :func:`~mita_experiments.benchmarks.timing.alternating_rounds`
OnRound = Callable[[int, dict[str, float]], None]

FAULTS = (
    "page faults/call: the process's minor page faults during that model's timed calls (median; blank "
    "where the OS does not report them), each a page of fresh memory touched for the first time. Which "
    "calls fault depends on the C allocator's heap (glibc gives large freed blocks back to the OS), so "
    "two models can differ in faults for the same work; an allocator that keeps freed memory "
    '(docs/performance.md, "Fresh memory") removes them.'
)


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
    its speed-up over the call ``baseline``, its median minor page faults a call (None where not
    counted) and whether its (warm-up) output is finite."""
    measured = alternating_rounds(calls, rounds, on_round=on_round)
    base = measured.median(baseline)
    return {
        name: {
            "median": measured.median(name),
            "speed-up": base / measured.median(name),
            "faults": measured.median_faults(name),
            "finite": bool(torch.isfinite(measured.outputs[name]).all()),
        }
        for name in calls
    }


def timed_rows(
    timed: dict[str, dict[str, Any]], columns: dict[str, Any], batch: int, unit: str, rounds: int
) -> list[dict[str, Any]]:
    """One row per call of :func:`side_by_side`'s result ``timed``: ``columns`` first (what was measured),
    then the call's name as ``attention``, its median seconds, ``unit``/s (``batch`` of them a forward),
    its speed-up, its page faults a call, the ``rounds`` and whether its output is finite."""
    return [
        {
            **columns,
            "attention": name,
            "forward s (median)": t["median"],
            f"{unit}/s": batch / t["median"],
            "speed-up": t["speed-up"],
            "page faults/call": t["faults"],
            "rounds": rounds,
            "finite": t["finite"],
        }
        for name, t in timed.items()
    ]


#: a point of a whole-model benchmark: its progress-bar description and what measures it (given the
#: progress callback), returning its rows
Point = tuple[str, Callable[[OnRound], list[dict[str, Any]]]]


def run_points(
    args: argparse.Namespace, target: str, points: Sequence[Point], title: str, method: Callable[[int], str]
) -> int:
    """``mita bench TARGET``'s run: under ``--threads``, ``--out`` prepared, each point measured with a
    progress bar over ``args.rounds`` rounds a point, then :func:`write_results` (``method`` gets the
    number of torch threads) and the report printed.

    Args:
        args (Namespace): the parsed flags (``threads``, ``out``, ``force``, ``rounds``).
        target (str): the target's name (``"seg"``), in the progress bar and the last line.
        points (sequence of Point): what to measure, in order.
        title (str): the report's title.
        method (callable): torch threads -> how it was measured.
    """
    with torch_threads(args.threads):
        out = prepare_out_dir(args.out, force=args.force, resume=False)
        bar, advance = progress(len(points) * args.rounds, f"mita bench {target}")
        rows = []
        with bar:
            for desc, measure in points:
                bar.set_description(desc)
                rows += measure(advance)
        report = write_results(out, rows, title, method(torch.get_num_threads()), command_line(args))
    print(report.read_text())
    print(f"mita bench {target}: results in {out}/ (results.csv, results.md)")
    return 0


def progress(total: int, desc: str) -> tuple[Any, OnRound]:
    """A progress bar over ``total`` timed rounds and the ``on_round`` callback that advances it."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="round", dynamic_ncols=True)

    def advance(_: int, seconds: dict[str, float]) -> None:
        bar.set_postfix({name: f"{t:.3g} s" for name, t in seconds.items()})
        bar.update()

    return bar, advance


def _cell(value: Any) -> Any:
    """A table cell: floats to 3 significant digits, trailing zeros kept (whole numbers from 100 up);
    None (not measured) blank."""
    if value is None:
        return ""
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
    if "page faults/call" in rows[0]:
        method = f"{method} {FAULTS}"
    text = f"# {title}\n\nCommand: `{command}`\n\nMachine: {machine}\n\n{method}\n\n{table}"
    atomic_write_text(out / REPORT, text)
    return out / REPORT
