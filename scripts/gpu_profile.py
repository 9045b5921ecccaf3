"""Where MiTA's GPU time goes: the CUDA kernels of one call, forward and forward+backward, by torch.profiler.

    python scripts/gpu_profile.py [--n 65536] [--head-dim 64] [--impl triton] [--dtype bfloat16] [--rows 25]

Per mode, prints the wall time of one call (synchronised, median of 20), the GPU time its kernels
took and how many kernels it launched, so that a call bound by the host (launches, Python) shows as
wall time well above GPU time; then the kernels sorted by total CUDA time and the operators by
self CPU time over three profiled calls (after two warm-up calls); SDPA's flash backend at the same
shape for scale. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from mita.ops.mita import mita_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=65536, help="sequence length N (default 65536)")
    parser.add_argument("--head-dim", type=int, default=64, help="D (default 64)")
    parser.add_argument("--heads", type=int, default=8, help="H (default 8), B = 1")
    parser.add_argument("--impl", default="triton", help="MiTA's impl (default triton)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rows", type=int, default=25, help="kernels listed per table (default 25)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile: no CUDA device visible to torch")
    dtype = getattr(torch, args.dtype)
    shape = (1, args.heads, args.n, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    ops = {
        "mita": lambda: mita_attention(q, k, v, num_landmarks=64, topk=64, impl=args.impl),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
    }
    for name, op in ops.items():
        for mode in ("fwd", "fwdbwd"):

            def step(op=op, mode=mode) -> None:
                out = op()
                if mode == "fwdbwd":
                    out.backward(torch.ones_like(out))

            for _ in range(2):
                step()
            torch.cuda.synchronize()
            walls = []
            for _ in range(20):
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - start)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu_ms = sum(e.device_time_total for e in kernels) / 3e3
            print(f"\n=== {name} {mode}: N={args.n} D={args.head_dim} H={args.heads} {args.dtype} ===")
            print(
                f"wall {statistics.median(walls) * 1e3:.3f} ms a call (median of 20, synchronised); "
                f"GPU kernels {gpu_ms:.3f} ms and {len(kernels) / 3:.0f} launches a call"
            )
            print(events.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=70))
            if name == "mita":
                print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
