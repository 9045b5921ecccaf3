"""Side-by-side GPU timings of the Triton path's choices, each pair in one process.

    python scripts/gpu_ab.py [--lengths 4096 16384 65536] [--dtype bfloat16] [--budget 240]

1. split-K: the shared expert's long products (``split_k_matmul``) against one plain matmul, by
   setting ``mita.ops.mita.triton.SPLIT_K`` (alternating A, B, A, B).
2. eager against ``torch.compile`` (inductor; and ``mode="reduce-overhead"``, its CUDA graphs, which
   remove the host's launch cost of the glue's ~110 small kernels a forward): forward under
   ``no_grad`` and forward+backward, with the compiled forward's largest difference to eager and the
   share of query rows that differ by more than 1e-2 (inductor keeps fused intermediates in float32,
   so a half-precision routing choice near a tie can flip).

B = 1, H = 8, D = 64, m = k = 64; medians of ``triton.testing.do_bench``. Needs a CUDA device.
Compilation stops being timed once ``--budget`` seconds have passed (each compile takes seconds).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

import mita.ops.mita.triton as mita_triton
from mita.ops.mita import mita_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536], help="sequence lengths N")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no more compiles start")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_ab: no CUDA device visible to torch")
    from triton.testing import do_bench

    start = time.time()
    dtype = getattr(torch, args.dtype)

    def ms(fn) -> float:
        return do_bench(fn, warmup=25, rep=200, return_mode="median")

    def attn(q, k, v):
        return mita_attention(q, k, v, num_landmarks=64, topk=64, impl="triton")

    def inputs(n: int, grad: bool):
        return [torch.randn(1, 8, n, 64, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(3)]

    def step(fn, x, train: bool) -> None:
        torch.compiler.cudagraph_mark_step_begin()
        if train:
            out = fn(*x)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                fn(*x)

    print(f"split-K ({args.dtype}): ms forward / forward+backward, plain matmul (A) and split_k_matmul (B)")
    block = mita_triton.SPLIT_K
    for n in args.lengths:
        x = inputs(n, True)
        cells = []
        for label, split in (("A", 1 << 62), ("B", block), ("A", 1 << 62), ("B", block)):
            mita_triton.SPLIT_K = split
            cells.append(f"{label} {ms(partial(step, attn, x, False)):.3f} / {ms(partial(step, attn, x, True)):.3f}")
        mita_triton.SPLIT_K = block
        print(f"N={n}: " + "   ".join(cells), flush=True)

    print(f"\neager and torch.compile ({args.dtype}): ms a call")
    for n in args.lengths:
        for train in (False, True):
            x = inputs(n, train)
            cells = []
            for mode in ("eager", "default", "reduce-overhead"):
                if mode != "eager" and time.time() - start > args.budget:
                    cells.append(f"{mode}: not run (--budget)")
                    continue
                fn = attn
                if mode != "eager":
                    torch.compiler.reset()  # each compile afresh: one code object, many shapes and modes
                    fn = torch.compile(attn, mode=mode, fullgraph=True, dynamic=False)
                for _ in range(3):
                    step(fn, x, train)
                cell = f"{mode} {ms(partial(step, fn, x, train)):.3f}"
                if mode != "eager" and not train:
                    with torch.no_grad():
                        diff = (fn(*x).float() - attn(*x).float()).abs().amax(-1)
                    cell += (
                        f" (max diff {diff.max().item():.2g}, rows > 1e-2: {(diff > 1e-2).float().mean().item():.2%})"
                    )
                cells.append(cell)
            print(f"N={n} {'fwd+bwd' if train else 'fwd'}: " + "   ".join(cells), flush=True)
    print(f"gpu_ab: done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
