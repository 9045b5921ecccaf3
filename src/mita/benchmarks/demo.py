"""``mita demo``: MiTA against SDPA on a few sequence lengths, printed as a table."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="a short demonstration: MiTA against SDPA")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    p.set_defaults(func=run)


def _median_time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    from ..ops.mita import mita_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 300, 32, dtype=torch.float64)
    opts = dict(num_landmarks=16, topk=16, num_routed=2)
    err = (mita_attention(q, k, v, **opts) - mita_attention(q, k, v, **opts, impl="reference")).abs().max()
    print(f"agreement with the reference (N=300, float64): max abs error {err:.2e}")
    print("| N | SDPA (ms) | MiTA (ms) | speed-up |\n|---|---|---|---|")
    with torch.inference_mode():
        for n in args.lengths:
            q, k, v = torch.randn(3, 1, 8, n, 64)
            t_sdpa = _median_time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v))
            t_mita = _median_time(lambda q=q, k=k, v=v: mita_attention(q, k, v, num_landmarks=64, topk=64))
            print(f"| {n} | {t_sdpa * 1e3:.1f} | {t_mita * 1e3:.1f} | {t_sdpa / t_mita:.1f}x |")
    return 0
