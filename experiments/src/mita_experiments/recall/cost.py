"""The layer-call cost of MiTA's options against repeated tokens (issue 31) beside the spec's.

Forward + backward of one op call on (B, H, N, D) = (32, 2, N, 32), m = 8, k = 16, three quarters
of the tokens one repeated token (the recall task's filler), one thread; the methods interleaved
round by round (a shared machine's load moves), the median of ``--rounds`` after a warm-up round.

    OMP_NUM_THREADS=1 python -m mita_experiments.recall.cost --out runs/recall-cost.csv --lengths 256 512 1024
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mita import mita_attention

from ..utils.files import atomic_write_text
from ..utils.machine import machine_info

FIELDS = ["N", "method", "ms_median", "rounds", "date", "machine"]
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _mita(**options: object) -> Op:
    return lambda q, k, v: mita_attention(q, k, v, num_landmarks=8, topk=16, **options)


#: the methods timed: the spec, each option, both, the grouped path, and dense attention
METHODS: dict[str, Op] = {
    "spec": _mita(),
    "distinct": _mita(landmark_pooling="distinct"),
    "merge": _mita(merge_duplicates=True),
    "distinct + merge": _mita(landmark_pooling="distinct", merge_duplicates=True),
    "spec (grouped)": _mita(impl="grouped"),
    "distinct + merge (grouped)": _mita(landmark_pooling="distinct", merge_duplicates=True, impl="grouped"),
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
}


def inputs(n: int, batch: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v (batch, 2, n, 32), requiring gradients, three quarters of the tokens one repeated token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, n, 96, generator=g)
    x[:, :, n // 4 :] = x[:, :, n // 4 : n // 4 + 1]
    return [t.contiguous().requires_grad_() for t in x.split(32, -1)]


def measure(lengths: list[int], rounds: int = 7, batch: int = 32) -> list[dict[str, object]]:
    """One row per (N, method): the median milliseconds of a forward + backward over ``rounds``."""
    info = machine_info()
    machine = f"{info['cpu_model']}, {info['usable_cpus']} usable CPUs, torch {info['torch']}, 1 thread"
    date = datetime.date.today().isoformat()
    rows = []
    for n in lengths:
        q, k, v = inputs(n, batch)
        grad = torch.randn_like(q)
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        for _ in range(rounds + 1):
            for name, op in METHODS.items():
                t0 = time.perf_counter()
                op(q, k, v).backward(grad)
                times[name].append(time.perf_counter() - t0)
                q.grad = k.grad = v.grad = None
        for name, t in times.items():
            ms = 1000 * statistics.median(t[1:])
            rows.append(
                {"N": n, "method": name, "ms_median": round(ms, 1), "rounds": rounds, "date": date, "machine": machine}
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024], help="sequence lengths N")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds after one warm-up round (default 7)")
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.lengths) < 8:
        p.error("--rounds must be >= 1 and every length >= 8")
    torch.set_num_threads(1)
    rows = measure(args.lengths, args.rounds)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(Path(args.out), buf.getvalue())
    for row in rows:
        print(f"N={row['N']:5d}  {row['method']:28s} {row['ms_median']:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
