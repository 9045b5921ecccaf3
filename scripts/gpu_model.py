"""A performance model on paper of MiTA's Triton path against FlashAttention-2 on one H100 SXM.

Not a measurement: each kernel's time is max(FLOPs / attainable FLOP/s, bytes / attainable
bandwidth) plus a launch cost, with the peak figures and efficiencies below (assumptions,
stated in docs/performance.md). Prints the markdown tables of docs/performance.md:
    python scripts/gpu_model.py
"""

from __future__ import annotations

PEAK_BF16 = 989e12  # H100 SXM dense bf16 tensor-core FLOP/s
PEAK_FP32 = 67e12  # H100 SXM fp32 (non-tensor) FLOP/s: torch's float32 matmuls, TF32 off by default
HBM = 3.35e12  # H100 SXM HBM3 bytes/s
FA2_FWD, FA2_BWD = 0.35, 0.30  # FlashAttention-2's fraction of the bf16 peak on an H100 (about 350 TFLOP/s forward)
TRITON_TC = 0.35  # our Triton kernels' fraction of the bf16 peak (as FA2's)
FP32_EFF, STREAM_EFF, GATHER_EFF = 0.6, 0.7, 0.5  # fp32 matmuls; streaming kernels' and gathers' share of HBM
LAUNCH_S = 5e-6  # per kernel launch (no CUDA graph)
B, H, M, K, S = 1, 8, 64, 64, 1  # the benchmark's shapes: m = k = 64, s = 1
E = 2  # bytes per bf16 element


def forward_kernels(n: int, d: int) -> list[tuple[str, float, float, str]]:
    """(kernel, FLOPs, bytes moved, kind) of one forward call, all heads."""
    x, tiles = B * H, B * H * (n * S / 64 + M)  # 64-row tiles: at most one partial tile per expert
    return [
        ("pool q into the landmarks", x * n * d, x * n * d * E, "stream"),
        ("q, k, v to float32 (affinities, gate)", 0, 3 * x * n * d * (E + 4), "stream"),
        ("A = Q~ K^T, float32", 2 * x * M * n * d, x * (n * d * 4 + M * n * 4), "fp32"),
        ("softmax(A) V and top-k of A", 2 * x * M * n * d, x * (3 * M * n * 4 + n * d * 4), "fp32"),
        ("gate q Q~^T, float32, and routing", 2 * x * n * M * d, x * (n * d * 4 + 2 * n * M * 4), "fp32"),
        ("tiling: argsort, searchsorted, scatter", 0, 64 * x * n * S, "gather"),
        ("Triton forward: joint softmax", x * n * d * (4 * M + 4 * S * K), _tile_bytes(tiles, d, x * n), "tc"),
        ("merge of the partials, cast", 0, 2 * x * n * S * (4 * d + 4) + x * n * d * E, "gather"),
    ]


def backward_kernels(n: int, d: int) -> list[tuple[str, float, float, str]]:
    """(kernel, FLOPs, bytes moved, kind) of one backward call, all heads."""
    x, tiles = B * H, B * H * (n * S / 64 + M)
    atomics = tiles * 2 * (M + K) * d * 4 * 2  # read-modify-write of float32 dK, dV, dQ~, dV~ rows
    return [
        ("delta = rowsum(dO * O)", 2 * x * n * d, 2 * x * n * d * E, "stream"),
        ("zeroed float32 gradient buffers", 0, x * (2 * n * d + 2 * M * d) * 4, "stream"),
        ("tiling (recomputed)", 0, 64 * x * n * S, "gather"),
        ("Triton backward", x * n * d * (10 * M + 10 * S * K), _tile_bytes(tiles, d, x * n, 2) + atomics, "tc"),
        ("dQ partial sums, casts", 0, x * n * S * d * 4 + 3 * x * n * d * (4 + E), "stream"),
        ("autograd of softmax(A) V, A, pooling", 6 * 2 * x * M * n * d, x * (4 * M * n * 4 + 4 * n * d * 4), "fp32"),
    ]


def _tile_bytes(tiles: float, d: int, rows: float, row_tensors: int = 1) -> float:
    """Each 64-row tile loads its query rows (and dO rows), the m landmarks and shared values and its
    expert's k keys and values; each row writes a float32 partial output (or dQ) and log-sum-exp."""
    return tiles * (64 * row_tensors + 2 * M + 2 * K) * d * E + rows * S * (4 * d + 4)


def seconds(kernels: list[tuple[str, float, float, str]]) -> float:
    peak = {"tc": PEAK_BF16 * TRITON_TC, "fp32": PEAK_FP32 * FP32_EFF, "stream": PEAK_FP32, "gather": PEAK_FP32}
    bw = {"tc": HBM * GATHER_EFF, "fp32": HBM * STREAM_EFF, "stream": HBM * STREAM_EFF, "gather": HBM * GATHER_EFF}
    return sum(max(f / peak[kind], b / bw[kind]) + LAUNCH_S for _, f, b, kind in kernels)


def main() -> None:
    head = "D | N | FA2 fwd GFLOP | MiTA fwd GFLOP | MiTA fwd GB | FA2 fwd ms | MiTA fwd ms | speed-up fwd"
    print(f"| {head} | FA2 fwd+bwd ms | MiTA fwd+bwd ms | speed-up fwd+bwd |")
    print("|---" * 11 + "|")
    for d in (64, 128):
        for n in (4096, 16384, 65536, 131072):
            flops = 4.0 * B * H * n * n * d
            fa_f, fa_b = flops / (PEAK_BF16 * FA2_FWD), 2.5 * flops / (PEAK_BF16 * FA2_BWD)
            fwd, bwd = forward_kernels(n, d), backward_kernels(n, d)
            mf, mb = seconds(fwd), seconds(bwd)
            gflop, gb = sum(k[1] for k in fwd) / 1e9, sum(k[2] for k in fwd) / 1e9
            fa, mita = fa_f + fa_b, mf + mb
            print(
                f"| {d} | {n:,} | {flops / 1e9:,.0f} | {gflop:.1f} | {gb:.2f} | {fa_f * 1e3:.2f} | {mf * 1e3:.2f} "
                f"| {fa_f / mf:.1f}x | {fa * 1e3:.1f} | {mita * 1e3:.2f} | {fa / mita:.1f}x |"
            )
    n, d = 65536, 64
    print(f"\nPer kernel at N = {n:,}, D = {d}:\n")
    print("| kernel | GFLOP | MB moved | predicted ms |")
    print("|---|---|---|---|")
    for name, f, b, kind in forward_kernels(n, d) + backward_kernels(n, d):
        print(f"| {name} | {f / 1e9:.2f} | {b / 1e6:,.0f} | {seconds([(name, f, b, kind)]) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
