"""Two or more versions of the fused CPU kernel, timed side by side in one process.

Each source is built under its own operator namespace (``mitaab0``, ``mitaab1``, ...), the
outputs and gradients of every version are checked against the first's, then the calls are
timed in alternating rounds (medians), so that a noisy machine moves every version alike.
The cases are the issue-11 presets (deit224, deit512), DeiT-S at 384 px (deit384) and at 224 px
with m = k = 49 (deit224m49), and the standard configuration. A version
is its fused_cpu.cpp, with the headers it includes (``#include "x.h"``) beside it:
    mkdir -p /tmp/old && git archive HEAD~3 src/mita/ops/mita/csrc | tar -x -C /tmp/old
    python scripts/kernel_ab.py /tmp/old/src/mita/ops/mita/csrc/fused_cpu.cpp \
        src/mita/ops/mita/csrc/fused_cpu.cpp --threads 1
``--layout qkv`` passes q, k, v as views of one (B, N, 3, H, D) buffer, as timm's attention and
mita's layers do (rows 3 H D apart), instead of three contiguous tensors.
With ``--dtypes`` each version runs in each dtype (inputs drawn in float32, then cast), every
(version, dtype) pair timed in the same alternating rounds, ratios to the first pair; versions
are checked against the first version in the same dtype. Half precision against float32:
    python scripts/kernel_ab.py src/mita/ops/mita/csrc/fused_cpu.cpp --dtypes float32 bfloat16 \
        --cases standard1024 standard4096 standard16384 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from mita.ops.mita import fused
from mita.ops.mita.config import check
from mita.ops.pooling import pool_bins

# name: (B, H, N, m = k, grid, prefix tokens)
CASES = {
    "deit224": (16, 6, 197, 25, (14, 14), 1),
    "deit224m49": (16, 6, 197, 49, (14, 14), 1),  # the same model run with larger m = k
    "deit384": (8, 6, 577, 25, (24, 24), 1),  # DeiT-S at 384 px
    "standard1024": (1, 8, 1024, 64, None, 0),
    "deit512": (4, 6, 1025, 49, (32, 32), 1),
    "standard4096": (1, 8, 4096, 64, None, 0),
    "standard8192": (1, 8, 8192, 64, None, 0),
    "standard16384": (1, 8, 16384, 64, None, 0),
}


def local_headers(source: Path) -> set[Path]:
    """The headers ``source`` includes with quotes, found beside it, and theirs in turn."""
    found: set[Path] = set()
    todo = [source]
    while todo:
        for name in re.findall(r'^#include "([^"]+)"', todo.pop().read_text(), flags=re.M):
            header = source.parent / name
            if header not in found:
                found.add(header)
                todo.append(header)
    return found


def build(sources: list[str], folder: Path) -> list[object]:
    """Each source compiled (ninja skips unchanged ones) and loaded; returns their torch.ops namespaces."""
    spaces = []
    for i, src in enumerate(sources):
        name = f"mitaab{i}"
        text = Path(src).read_text().replace("TORCH_LIBRARY(mita,", f"TORCH_LIBRARY({name},")
        text = text.replace("TORCH_LIBRARY_IMPL(mita,", f"TORCH_LIBRARY_IMPL({name},")
        build_dir = folder / name
        build_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if why := fused.unsafe_reason(build_dir):  # as the kernel cache: load no code another user could swap
            raise SystemExit(f"kernel_ab: {why}; pass --build with a folder of your own")
        copy = build_dir / "fused_cpu.cpp"
        files = {copy: text, **{build_dir / h.name: h.read_text() for h in local_headers(Path(src))}}
        for path, content in files.items():
            if not path.exists() or path.read_text() != content:
                path.write_text(content)
        flags = fused._cflags()
        load(
            name=name,
            sources=[str(copy)],
            build_directory=str(build_dir),
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        spaces.append(getattr(torch.ops, name))
    return spaces


def inputs(B: int, H: int, N: int, layout: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and dout (B, H, N, 64), drawn in float32 then cast: each contiguous (``bhnd``), or q, k, v
    as views of one (B, N, 3, H, 64) buffer, as timm's attention and mita's layers pass them (``qkv``)."""
    gen = torch.Generator().manual_seed(0)
    if layout == "qkv":
        qkv = torch.randn(B, N, 3, H, 64, generator=gen).to(dtype)
        return [*qkv.permute(2, 0, 3, 1, 4).unbind(0), torch.randn(B, H, N, 64, generator=gen).to(dtype)]
    return [torch.randn(B, H, N, 64, generator=gen).to(dtype) for _ in range(4)]


def time_case(
    case: str,
    spaces: list[object],
    modes: list[str],
    rounds: int,
    dtypes: list[str],
    check_versions: bool = True,
    layout: str = "bhnd",
) -> None:
    """Checks every version against the first (in each dtype; unless ``check_versions`` is False),
    then prints the medians and ratios of every (version, dtype) pair."""
    B, H, N, m, grid, prefix = CASES[case]
    q, k, v, _ = inputs(B, H, N, layout, torch.float32)
    cfg = check(
        q,
        k,
        v,
        num_landmarks=m,
        topk=m,
        num_routed=1,
        grid=grid,
        num_prefix_tokens=prefix,
        key_padding_mask=None,
        query_padding_mask=None,
        scale=None,
        landmark_scale=None,
        landmarks=None,
        branches="both",
        dropout_p=0.0,
    )
    bins = pool_bins(cfg.pooling, N)
    # (version, dtype) pairs, each with its inputs: the first version in each dtype is its yardstick.
    pairs = [(i, ns, getattr(torch, dt)) for dt in dtypes for i, ns in enumerate(spaces)]
    data = {dt: inputs(B, H, N, layout, dt) for _, _, dt in pairs}

    def fwd_args(dt: torch.dtype) -> tuple:
        q, k, v, _ = data[dt]
        return (q, k, v, None, None, None, m, 1, cfg.scale, cfg.landmark_scale, *bins)

    def backward(ns: object, dt: torch.dtype, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        q, k, v, dout = data[dt]
        out, experts, routes, lm, v_shared, lse_a, lse_t = saved
        args = (dout, q, k, v, lm, None, None, experts, routes, out, v_shared, lse_a, lse_t)
        return ns.fused_backward(*args, cfg.scale, cfg.landmark_scale, *bins)

    saved = [ns.fused_forward(*fwd_args(dt)) for _, ns, dt in pairs]
    grads = [backward(ns, dt, s) for (_, ns, dt), s in zip(pairs, saved)]
    first = {dt: j for j, (_, _, dt) in reversed(list(enumerate(pairs)))}
    for j, (i, _, dt) in enumerate(pairs if check_versions else []):
        # half precision: a few output ulps apart (bfloat16's ulp is 2^-8 to 2^-7 of the value)
        tol = {torch.bfloat16: 2e-2, torch.float16: 1e-2}.get(dt, 1e-3)
        names = ("out", "experts", "routes", "landmarks", "v_shared", "lse_a", "lse_t", "dq", "dk", "dv")
        for name, a, b in zip(names, saved[first[dt]] + grads[first[dt]], saved[j] + grads[j]):
            same = torch.equal(a, b) if a.dtype == torch.long else torch.allclose(a, b, rtol=tol, atol=tol / 10)
            if not same:
                gap = (a != b).sum().item() if a.dtype == torch.long else (a.double() - b.double()).abs().max().item()
                raise SystemExit(f"{case}: version {i} disagrees with version 0 in {dt}: {name} ({gap:.3g})")
    names = [f"v{i}" + (f" {str(dt)[6:]}" if len(dtypes) > 1 else "") for i, _, dt in pairs]
    for mode in modes:
        if mode == "fwd":
            calls = [functools.partial(ns.fused_forward, *fwd_args(dt)) for _, ns, dt in pairs]
        else:
            calls = [functools.partial(backward, ns, dt, s) for (_, ns, dt), s in zip(pairs, saved)]
        t0 = time.perf_counter()
        calls[0]()
        reps = max(1, int(0.2 / (time.perf_counter() - t0)))
        times: list[list[float]] = [[] for _ in calls]
        for _ in range(rounds):
            for call, ts in zip(calls, times):
                t0 = time.perf_counter()
                for _ in range(reps):
                    call()
                ts.append((time.perf_counter() - t0) / reps)
        med = [statistics.median(ts) for ts in times]
        cells = "  ".join(f"{name} {t * 1e3:.2f} ms ({t / med[0]:.3f})" for name, t in zip(names, med))
        print(f"{case} {mode} ({torch.get_num_threads()} threads, {rounds} rounds): {cells}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", help="fused_cpu.cpp versions; ratios are to the first")
    p.add_argument("--cases", nargs="+", default=["deit224", "deit512"], choices=list(CASES))
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "float64", "bfloat16", "float16"],
        help="each version timed in each (default: float32); ratios are to the first version's first dtype",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip the agreement check: versions that compute differently (bfloat16 products against float32"
        " scratch, whose routing may differ) are tested by tests/test_mita_fused.py instead",
    )
    p.add_argument(
        "--layout",
        default="bhnd",
        choices=["bhnd", "qkv"],
        help="q, k, v each contiguous (default), or views of one (B, N, 3, H, D) buffer, as timm's attention passes"
        " them",
    )
    p.add_argument("--build", type=Path, default=fused.cache_root() / "kernel-ab", help="build folder (yours)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spaces = build(args.sources, args.build)
    for case in args.cases:
        time_case(case, spaces, args.modes, args.rounds, args.dtypes, not args.no_check, args.layout)


if __name__ == "__main__":
    main()
