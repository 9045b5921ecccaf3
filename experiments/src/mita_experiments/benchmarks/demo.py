"""``mita demo``: the fast paths agree with the reference, and MiTA against SDPA at a few lengths.

A short, real run (well under a minute on two cores): the agreement of the fast paths
(fused C++ kernels, grouped PyTorch) with the spec's reference on a small float64 case,
then a table of the forward time, peak memory and speed-up of MiTA over SDPA in the
standard configuration (spec section 4), measured like ``mita bench --rounds 3`` does (the two
side by side in alternating rounds, so the ratio holds on a machine whose speed drifts).
"""

from __future__ import annotations

import argparse

import torch

from mita.ops.mita import fused

from .bench import PRESETS, Settings, add_ratios, make_series, measure_rows, new_row
from .report import markdown_table
from .timing import Case

AGREEMENT_TOL = 1e-9  # float64; the paths differ only in the order of sums
DEMO_COLUMNS = ("n", "series", "time", "peak", "memory_ratio", "speedup", "ideal")


HELP = "a short demonstration: agreement with the reference, MiTA against SDPA"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mita demo`` (registered by :mod:`mita_experiments.benchmarks.cli`)."""
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192], metavar="N")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")


def agreement(n: int = 300, seed: int = 0) -> dict[str, float]:
    """Max abs difference from the reference, float64, of each fast path's output and gradients
    (the fused kernels only where they are available)."""
    from mita.ops.mita import mita_attention

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 32, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
    opts = {"num_landmarks": 16, "topk": 16, "num_routed": 2}
    results = {}
    for impl in ("reference", "fused", "grouped"):
        if impl == "fused" and not fused.available():
            continue
        out = mita_attention(q, k, v, **opts, impl=impl)
        results[impl] = (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    ref = results.pop("reference")
    errors = {}
    for impl, (out, *grads) in results.items():
        errors[f"{impl} output"] = (out - ref[0]).abs().max().item()
        errors[f"{impl} gradients"] = max((a - b).abs().max().item() for a, b in zip(grads, ref[1:]))
    return errors


def run(args: argparse.Namespace) -> int:
    if min(args.lengths) < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError(f"--lengths and --threads must be positive, got {args.lengths} and {args.threads}")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        used_threads = torch.get_num_threads()
        errors = agreement()
        kernel = "fused C++ kernels" if fused.available() else "grouped path: the fused kernels are not available"
        print(
            "Agreement of the fast paths with the reference (N=300, m=k=16, s=2, float64), max abs error: "
            + ", ".join(f"{err:.1e} ({what})" for what, err in errors.items())
            + f"\nMiTA on CPU runs on the {kernel}.\n"
        )
        preset = PRESETS["standard"]
        sdpa, mita = make_series("sdpa"), make_series("mita")
        settings = Settings(rounds=3)
        rows = []
        for n in args.lengths:
            case = Case(preset.batch, preset.heads, n, preset.head_dim)
            options = [s.options_at(preset, n) for s in (sdpa, mita)]
            points = [(new_row(s, o, case, "fwd", "demo"), o) for s, o in zip((sdpa, mita), options)]
            base, row = measure_rows(points, case, settings)
            rows += [add_ratios(base, base), add_ratios(row, base)]
    finally:
        torch.set_num_threads(threads)
    print(
        f"Forward pass, B={preset.batch}, H={preset.heads}, D={preset.head_dim}, float32, m=k=64, s=1, "
        f"{used_threads} threads "
        "(peak / ref: peak memory over the size of q, k, v and the output):\n"
    )
    print(markdown_table(rows, DEMO_COLUMNS))
    print("More: `mita bench` (forward and backward, all methods, plots); see docs/performance.md.")
    if max(errors.values()) > AGREEMENT_TOL:
        print(f"mita demo: a fast path differs from the reference by more than {AGREEMENT_TOL:g}")
        return 1
    return 0
