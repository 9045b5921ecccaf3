"""Grids of recall runs (methods x N x P x seeds) that resume where they stopped, and their plots.

Every finished run is one row of ``<out>/results.csv``; a run whose row is there is skipped,
a run stopped mid-way is resumed from its checkpoint (``<out>/runs/<name>``), so the same
command re-run continues the grid. Plots: accuracy against P per method at each N with two
or more P, and accuracy against N at each P/N with two or more N.
"""

from __future__ import annotations

import csv
import fcntl
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import trainer
from ..lra.config import apply_overrides
from . import task

RESULTS = "results.csv"
FIELDS = [
    "attention",
    "seq_len",
    "num_pairs",
    "vocab_size",
    "form",
    "seed",
    "steps",
    "max_steps",
    "batch_size",
    "test_accuracy",
    "test_accuracy_best_val",
    "val_accuracy_prev",
    "val_accuracy_last",
    "status",
    "train_seconds",
    "seconds_per_step",
    "run_dir",
    "finished_utc",
]


@dataclass(frozen=True)
class Cell:
    """One run of a grid."""

    attention: str
    seq_len: int
    num_pairs: int
    seed: int

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.attention, self.seq_len, self.num_pairs, self.seed)

    @property
    def name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.attention).strip("-")
        return f"{slug}-N{self.seq_len}-P{self.num_pairs}-s{self.seed}"


def grid(
    methods: Iterable[str],
    lengths: Iterable[int],
    pairs: Iterable[int] | None = None,
    ratio: float | None = None,
    seeds: Iterable[int] = (0,),
) -> list[Cell]:
    """The cells of methods x lengths x (``pairs``, or P = round(``ratio`` * N)) x seeds."""
    if (pairs is None) == (ratio is None):
        raise ValueError("give either pairs (P values) or ratio (P = ratio * N), not both and not neither")
    if ratio is not None and not 0 < ratio < 0.5:
        raise ValueError(f"ratio must be in (0, 0.5), got {ratio}")
    cells = []
    for n in lengths:
        ps = list(pairs) if pairs is not None else [max(1, round(ratio * n))]
        cells += [Cell(m, int(n), int(p), int(s)) for m in methods for p in ps for s in seeds]
    return cells


def read_results(out: str | Path) -> list[dict[str, str]]:
    """The rows of ``<out>/results.csv`` (none if it does not exist)."""
    path = Path(out) / RESULTS
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _row_key(row: dict[str, str]) -> tuple[str, int, int, int]:
    return (row["attention"], int(row["seq_len"]), int(row["num_pairs"]), int(row["seed"]))


def _val_history(run_dir: Path) -> list[float]:
    with open(run_dir / trainer.METRICS, newline="") as f:
        return [float(r["accuracy"]) for r in csv.DictReader(f) if r["split"] == "val"]


def status(prev: float, last: float) -> str:
    """ "solved" (last validation accuracy >= 99%), "flat" (it moved < 1 point over the last
    evaluation interval: converged, or a plateau when near chance) or "rising"."""
    if last >= 0.99:
        return "solved"
    return "flat" if abs(last - prev) < 0.01 else "rising"


def cell_config(cell: Cell, overrides: list[str], batch_tokens: int | None = None) -> dict[str, Any]:
    """The checked configuration of one cell: the sweep's ``overrides`` (``section.key=value``), then the
    grid's values, which win (so an override such as ``data.train_lengths`` is checked against the
    cell's N, not the default's). ``batch_tokens``: the batch is min(train.batch_size,
    batch_tokens // N) sequences (the same tokens per step at every N)."""
    grid_values = {"data.seq_len": cell.seq_len, "data.num_pairs": cell.num_pairs}
    grid_values |= {"train.seed": cell.seed, "data.seed": cell.seed}
    kept = [item for item in overrides if item.split("=", 1)[0].strip() not in grid_values]
    cfg = task.config(overrides=[*kept, *(f"{key}={value}" for key, value in grid_values.items())])
    if batch_tokens is not None:
        batch = max(1, min(int(cfg["train"]["batch_size"]), batch_tokens // cell.seq_len))
        cfg = apply_overrides(cfg, {"train.batch_size": batch})
    return cfg


def run_cell(
    cell: Cell,
    out: Path,
    overrides: list[str],
    batch_tokens: int | None = None,
    progress: bool = False,
    tensorboard: bool = True,
) -> dict[str, Any]:
    """Train (or resume) one cell and return its results row (``overrides`` and ``batch_tokens`` as
    :func:`cell_config` takes them)."""
    cfg = cell_config(cell, overrides, batch_tokens)
    run_dir = out / "runs" / cell.name
    resume = (run_dir / trainer.CHECKPOINT).exists()  # a folder killed before its first checkpoint is reused
    data = task.task_data(cfg["data"])
    summary = task.train(cfg, data, run_dir, cell.attention, resume=resume, progress=progress, tensorboard=tensorboard)
    history = _val_history(run_dir)
    prev, last = (history[-2], history[-1]) if len(history) > 1 else (float("nan"), history[-1])
    spec = task.spec_of(cfg["data"])
    return {
        "attention": cell.attention,
        "seq_len": cell.seq_len,
        "num_pairs": cell.num_pairs,
        "vocab_size": spec.vocab_size,
        "form": spec.form,
        "seed": cell.seed,
        "steps": summary["step"],
        "max_steps": summary["steps"],
        "batch_size": cfg["train"]["batch_size"],
        "test_accuracy": summary["test_accuracy_last"],
        "test_accuracy_best_val": summary.get("test_accuracy_best_val", ""),
        "val_accuracy_prev": prev,
        "val_accuracy_last": last,
        "status": status(prev, last),
        "train_seconds": summary["train_seconds"],
        "seconds_per_step": summary["train_seconds"] / max(summary["step"], 1),
        "run_dir": str(run_dir.relative_to(out)),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def sweep(
    cells: list[Cell],
    out: str | Path,
    overrides: list[str] | None = None,
    batch_tokens: int | None = None,
    progress: bool = False,
) -> Iterator[dict[str, Any]]:
    """Run the cells not yet in ``<out>/results.csv``, appending one row per finished run; yields the rows.
    ``overrides`` (``section.key=value``) and ``batch_tokens`` apply to every run (see ``run_cell``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = {_row_key(r) for r in read_results(out)}
    path = out / RESULTS
    for cell in cells:
        if cell.key in done:
            continue
        row = run_cell(cell, out, list(overrides or []), batch_tokens, progress=progress)
        append_row(path, row, FIELDS)
        done.add(cell.key)
        yield row


def append_row(path: Path, row: dict[str, Any], fields: list[str]) -> None:
    """Append ``row`` to the CSV ``path`` (header first if it is new), under a lock: two sweeps
    may share a folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        writer = csv.DictWriter(f, fields)
        if f.seek(0, 2) == 0:
            writer.writeheader()
        writer.writerow(row)


def plot(out: str | Path, rows: list[dict[str, str]] | None = None) -> list[Path]:
    """``acc_vs_pairs.png`` (accuracy against P per method, one panel per N with two or more P),
    ``acc_vs_length.png`` (against N, one panel per P/N with two or more N) and
    ``acc_vs_length_at_p.png`` (against N, one panel per P with two or more N), mean over seeds;
    each only where it has a line of two points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = read_results(out) if rows is None else rows
    acc: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        acc.setdefault((r["attention"], int(r["seq_len"]), int(r["num_pairs"])), []).append(float(r["test_accuracy"]))
    mean = {k: sum(v) / len(v) for k, v in acc.items()}
    methods = sorted({k[0] for k in mean}, key=lambda m: [r["attention"] for r in rows].index(m))
    written = []

    def panels(groups: dict[Any, dict[str, list[tuple[float, float]]]], xlabel: str, title: str, name: str) -> None:
        groups = {g: lines for g, lines in groups.items() if max(len(p) for p in lines.values()) > 1}
        if not groups:
            return
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
        for ax, (g, lines) in zip(axes[0], sorted(groups.items())):
            for m in methods:
                if m in lines:
                    xs, ys = zip(*sorted(lines[m]))
                    ax.plot(xs, [100 * y for y in ys], marker="o", label=m)
            ax.set(xscale="log", xlabel=xlabel, ylabel="test accuracy at query positions (%)", ylim=(-2, 102))
            ax.set_title(title.format(g))
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    by_n: dict[int, dict[str, list[tuple[float, float]]]] = {}
    by_ratio: dict[str, dict[str, list[tuple[float, float]]]] = {}
    by_p: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for (m, n, p), a in mean.items():
        by_n.setdefault(n, {}).setdefault(m, []).append((p, a))
        by_ratio.setdefault(f"{p / n:.4g}", {}).setdefault(m, []).append((n, a))
        by_p.setdefault(p, {}).setdefault(m, []).append((n, a))
    panels(by_n, "pairs P", "N = {}", "acc_vs_pairs.png")
    panels(by_ratio, "sequence length N", "P / N = {}", "acc_vs_length.png")
    panels(by_p, "sequence length N", "P = {}", "acc_vs_length_at_p.png")
    return written


def table(rows: list[dict[str, str]]) -> str:
    """A Markdown table of ``rows``: one line per method, one column per (N, P) with the test
    accuracy (%, mean over seeds), the runs' status, steps taken and training seconds."""
    methods = list(dict.fromkeys(r["attention"] for r in rows))
    cols = sorted({(int(r["seq_len"]), int(r["num_pairs"])) for r in rows})
    cells: dict[tuple[str, int, int], list[dict[str, str]]] = {}
    for r in rows:
        cells.setdefault((r["attention"], int(r["seq_len"]), int(r["num_pairs"])), []).append(r)
    head = "| method | " + " | ".join(f"N={n}, P={p}" for n, p in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for m in methods:
        out = []
        for n, p in cols:
            runs = cells.get((m, n, p))
            if not runs:
                out.append("")
                continue
            acc = 100 * sum(float(r["test_accuracy"]) for r in runs) / len(runs)
            secs = sum(float(r["train_seconds"]) for r in runs) / len(runs)
            steps = sum(int(r["steps"]) for r in runs) / len(runs)
            status = "/".join(sorted({r["status"] for r in runs}))
            out.append(f"{acc:.1f}% ({status}, {steps:.0f} steps, {secs:.0f} s)")
        lines.append(f"| `{m}` | " + " | ".join(out) + " |")
    return "\n".join(lines)
