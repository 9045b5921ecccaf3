"""The benchmark's outputs: CSV rows, the derived ratios, the markdown table, the plots, the machine.

A row is a ``dict[str, str]`` with the keys :data:`FIELDS`, the form it has in the CSV
file, so a resumed run reads back exactly what an earlier run wrote.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import shlex
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .timing import Case

FIELDS = (
    "session",
    "device",
    "dtype",
    "batch",
    "heads",
    "head_dim",
    "series",
    "method",
    "options",
    "n",
    "mode",
    "status",
    "median_s",
    "repeats",
    "tokens_per_s",
    "page_faults",
    "peak_bytes",
    "reference_bytes",
    "memory_ratio",
    "model_flops",
    "speedup",
    "ideal_speedup",
    "fraction_of_ideal",
    "gflops_per_s",
    "matmul_gflops_per_s",
    "share_of_matmul",
    "baseline_session",
)
#: FLOPs of a step per forward FLOP: the backward's products are twice the forward's (dX and dW per product)
PASSES = {"fwd": 1, "fwdbwd": 3}
OK = "ok"
Row = dict[str, str]


def fmt(x: float | int | None) -> str:
    """A CSV cell: empty for None, integers as is, floats to 6 significant digits."""
    if x is None:
        return ""
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def point_row(
    session: str, case: Case, series: str, method: str, options: str, mode: str, flops_per_head: float | None
) -> Row:
    """The row of a point before it is measured: what, where, the call's options, and the FLOP
    model of the whole batch (``flops_per_head`` times B and H; None: not modelled)."""
    row = dict.fromkeys(FIELDS, "")
    row.update(
        session=session,
        device=case.device,
        dtype=case.dtype,
        batch=str(case.batch),
        heads=str(case.heads),
        head_dim=str(case.head_dim),
        series=series,
        method=method,
        options=options,
        n=str(case.n),
        mode=mode,
        model_flops=fmt(None if flops_per_head is None else flops_per_head * case.batch * case.heads),
    )
    return row


def num(cell: str) -> float | None:
    """The inverse of :func:`fmt` for numbers."""
    return float(cell) if cell else None


def ratios(median_s: float, baseline_s: float | None, flops: float | None, baseline_flops: float | None) -> Row:
    """Speed-up over the baseline, the FLOP model's ideal speed-up, and the fraction of it achieved."""
    speedup = baseline_s / median_s if baseline_s is not None else None
    ideal = baseline_flops / flops if flops and baseline_flops else None
    fraction = speedup / ideal if speedup is not None and ideal is not None else None
    return {"speedup": fmt(speedup), "ideal_speedup": fmt(ideal), "fraction_of_ideal": fmt(fraction)}


def read_rows(path: Path) -> list[Row]:
    """The rows of a results file; a line cut short by an interrupted run is dropped (it is measured again)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != FIELDS:
            raise ValueError(f"{path} is not a results file of this version of mita bench (columns differ)")
        return [r for r in reader if None not in r and None not in r.values()]


def write_rows(path: Path, rows: Iterable[Row]) -> None:
    """Replace the CSV file with ``rows`` (written aside, then renamed: never a half-written file)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


class CsvLog:
    """Appends rows to a CSV file made by :func:`write_rows`, one at a time and flushed, so an
    interrupted run can resume."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=FIELDS)

    def write(self, row: Row) -> None:
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


_COLUMNS: dict[str, tuple[str, Callable[[Row], str]]] = {
    "series": ("method", lambda r: r["series"]),
    "options": ("options", lambda r: r["options"]),
    "n": ("N", lambda r: r["n"]),
    "mode": ("mode", lambda r: r["mode"]),
    "time": ("time (ms)", lambda r: f"{float(r['median_s']) * 1e3:.2f}" if r["status"] == OK else r["status"]),
    "repeats": ("repeats", lambda r: r["repeats"]),
    "tokens": ("tokens/s", lambda r: f"{float(r['tokens_per_s']):,.0f}" if r["tokens_per_s"] else ""),
    "peak": ("peak (MiB)", lambda r: f"{float(r['peak_bytes']) / 2**20:.1f}" if r["peak_bytes"] else ""),
    "memory_ratio": ("peak / ref", lambda r: f"{float(r['memory_ratio']):.2f}" if r["memory_ratio"] else ""),
    "speedup": ("speed-up", lambda r: f"{float(r['speedup']):.2f}x{_dagger(r)}" if r["speedup"] else ""),
    "ideal": ("ideal", lambda r: f"{float(r['ideal_speedup']):.1f}x" if r["ideal_speedup"] else ""),
    "fraction": ("of ideal", lambda r: f"{float(r['fraction_of_ideal']):.0%}" if r["fraction_of_ideal"] else ""),
    "gflops": ("GFLOP/s", lambda r: f"{float(r['gflops_per_s']):.1f}" if r.get("gflops_per_s") else ""),
    "matmul": ("of matmul", lambda r: f"{float(r['share_of_matmul']):.0%}" if r.get("share_of_matmul") else ""),
}
TABLE_COLUMNS = tuple(_COLUMNS)
OTHER_SESSION = "†: the baseline was measured in another session of this run (--resume): same machine, another process"


def from_other_session(row: Row) -> bool:
    """Whether the row's speed-up is over a baseline measured by another session (a resumed run)."""
    return row["baseline_session"] not in ("", row["session"])


def _dagger(row: Row) -> str:
    return "†" if from_other_session(row) else ""


def markdown_table(rows: Iterable[Row], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    """A markdown table of the rows with the given columns (keys of ``_COLUMNS``)."""
    unknown = [c for c in columns if c not in _COLUMNS]
    if unknown:
        raise ValueError(f"unknown table columns {unknown}; valid: {list(_COLUMNS)}")
    head = [_COLUMNS[c][0] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_COLUMNS[c][1](r) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def command_line(args: argparse.Namespace) -> str:
    """The ``mita bench`` command of a run as it was typed (the parser records its arguments in
    ``bench_argv``), or its arguments when the namespace was made in Python."""
    if hasattr(args, "bench_argv"):
        return shlex.join(["mita", "bench", *args.bench_argv])
    return "mita bench, from Python: " + ", ".join(f"{k}={v!r}" for k, v in vars(args).items() if k != "func")


def session_info(session: str, command: str) -> dict[str, object]:
    """When and how this run was started, and how busy the machine was (1, 5, 15-minute load average)."""
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {
        "session": session,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "load_average": load,
    }


def _series(rows: Iterable[Row], mode: str, value: Callable[[Row], float | None]) -> dict[str, list[tuple]]:
    """Per series, the (n, value) points of ``mode`` that have a value, sorted by n."""
    out: dict[str, list[tuple]] = {}
    for r in rows:
        if r["mode"] == mode and r["status"] == OK and (y := value(r)) is not None:
            out.setdefault(r["series"], []).append((int(r["n"]), y))
    return {k: sorted(v) for k, v in out.items()}


def crossovers(rows: Sequence[Row], baseline: str) -> list[str]:
    """Per series and mode, from which measured N on it is at least as fast as the baseline."""
    lines = []
    for mode in [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m for r in rows)]:
        for series, pts in _series(rows, mode, lambda r: num(r["speedup"])).items():
            if series == baseline:
                continue
            slower = [n for n, speedup in pts if speedup < 1]
            if not slower:
                text = f"as fast or faster at every measured N ({pts[0][0]} to {pts[-1][0]})"
            elif slower[-1] == pts[-1][0]:
                text = f"slower at the largest measured N ({pts[-1][0]})"
            else:
                text = (
                    f"as fast or faster from N = {min(n for n, _ in pts if n > slower[-1])} on (slower at {slower[-1]})"
                )
            lines.append(f"- {series}, {_TITLES[mode]}: {text}")
    return lines


def plot(rows: Sequence[Row], out_dir: Path, baseline: str) -> list[Path]:
    """Log-log plots against N, one panel per mode: time.png, speedup.png (with the ideal), memory.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    modes = [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m for r in rows)]
    names = list(dict.fromkeys(r["series"] for r in rows))
    colors = {s: f"C{i % 10}" for i, s in enumerate(names)}
    markers = {s: "os^Dv"[i // 10 % 5] for i, s in enumerate(names)}  # past ten series the colours repeat
    lengths = sorted({int(r["n"]) for r in rows})
    specs = {
        "time.png": ("median time per call (s)", lambda r: num(r["median_s"]), None),
        "speedup.png": (f"speed-up over {baseline}", lambda r: num(r["speedup"]), lambda r: num(r["ideal_speedup"])),
        "memory.png": ("peak memory (MiB)", lambda r: _mib(r["peak_bytes"]), lambda r: _mib(r["reference_bytes"])),
    }
    paths = []
    for name, (ylabel, value, dashed) in specs.items():
        width = 6.5 + (1.8 if len(names) > 8 else 0)
        fig, axes = plt.subplots(1, len(modes), figsize=(width * len(modes), 4.8), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            for series, pts in _series(rows, mode, value).items():
                if not (name == "speedup.png" and series == baseline):
                    ax.plot(*zip(*pts), "-", marker=markers[series], color=colors[series], label=series)
            extra = _series(rows, mode, dashed) if dashed else {}
            if name == "speedup.png":
                for series, pts in extra.items():
                    ax.plot(*zip(*pts), "--", color=colors[series], alpha=0.5)
                ax.add_line(Line2D([], [], ls="--", color="grey", label="ideal (FLOP model)"))
            elif extra:  # the reference size is the same for every method
                ref = "q, k, v, out" + (" + their gradients" if mode == "fwdbwd" else "")
                ax.plot(*zip(*next(iter(extra.values()))), "k:", label=ref)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(lengths, [str(n) for n in lengths], minor=False)
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set(xlabel="sequence length N", ylabel=ylabel, title=_TITLES[mode])
            ax.grid(True, which="both", alpha=0.3)
            if len(names) > 8:  # beside the panel: inside it would hide the lines
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
            else:
                ax.legend(fontsize=7, loc="best")
        r = rows[0]
        fig.suptitle(f"B={r['batch']}, H={r['heads']}, D={r['head_dim']}, {r['dtype']}, {r['device']}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}


def _mib(cell: str) -> float | None:
    return None if not cell else float(cell) / 2**20


def measured_row(row: Row, m: Any, tokens: int, matmul_gflops: float | None = None) -> Row:
    """``row`` completed with a measurement ``m`` (median_s, repeats, peak_bytes, reference_bytes, faults)
    of ``tokens``; with the FLOP model's GFLOP/s (forward+backward counted as 3 forwards) and, given the machine's
    ``matmul_gflops`` in the row's dtype, its share of that physical limit."""
    flops = num(row["model_flops"])
    rate = flops * PASSES[row["mode"]] / m.median_s / 1e9 if flops else None
    return {
        **row,
        "gflops_per_s": fmt(rate),
        "matmul_gflops_per_s": fmt(matmul_gflops),
        "share_of_matmul": fmt(rate / matmul_gflops if rate is not None and matmul_gflops else None),
        "status": OK,
        "median_s": fmt(m.median_s),
        "repeats": str(m.repeats),
        "tokens_per_s": fmt(tokens / m.median_s),
        "page_faults": fmt(m.faults),
        "peak_bytes": fmt(m.peak_bytes),
        "reference_bytes": fmt(m.reference_bytes),
        "memory_ratio": fmt(m.peak_bytes / m.reference_bytes if m.peak_bytes is not None else None),
    }


def progress_line(what: str, row: Row, width: int = 10, decimals: int = 2) -> str:
    """A measured row as one progress line: ``what`` (the point), then the row's status if it failed,
    else its median in ms (``width`` wide, ``decimals`` decimals) and its speed-up when it has one."""
    if row["status"] != OK:
        return f"{what} {row['status']}"
    speedup = f"  {float(row['speedup']):.2f}x" if row["speedup"] else ""
    return f"{what} {float(row['median_s']) * 1e3:{width}.{decimals}f} ms{speedup}"


def add_ratios(row: Row, baseline_row: Row | None) -> Row:
    """The row with its speed-up over the baseline row (if measured) and the FLOP model's ideal."""
    if row["status"] != OK:
        return row
    base = baseline_row or {}
    base_s = num(base["median_s"]) if base.get("status") == OK else None
    derived = ratios(float(row["median_s"]), base_s, num(row["model_flops"]), num(base.get("model_flops", "")))
    return {**row, **derived, "baseline_session": base["session"] if base_s is not None else ""}
