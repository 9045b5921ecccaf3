"""``mita bench --device cuda``: MiTA's GPU paths against SDPA's backends and flash-attn, on one GPU.

Series: MiTA with ``impl="triton"`` and ``impl="grouped"``; ``F.scaled_dot_product_attention``
restricted (``torch.nn.attention.sdpa_kernel``) to each of its FLASH_ATTENTION,
EFFICIENT_ATTENTION and CUDNN_ATTENTION backends; and flash-attn's ``flash_attn_func`` when
it is installed. Every (dtype, head dim, N, mode) point is timed by
:func:`mita_experiments.benchmarks.timing.measure` (median after warm-up, CUDA-synchronised, peak
CUDA memory); speed-ups are over SDPA's FLASH_ATTENTION backend at the same point, in the
same process. A backend that cannot run a point (not built, head dim, out of memory) gets
a "failed" row and the run goes on. Outputs: ``results.csv`` (rows appended as measured),
``results.md`` (one table per dtype and head dim) and ``machine.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from mita.ops.mita import mita_attention, mita_flops

from ..utils.machine import machine_info
from .report import (
    OK,
    CsvLog,
    Row,
    add_ratios,
    command_line,
    markdown_table,
    measured_row,
    point_row,
    progress_line,
    session_info,
    write_rows,
)
from .timing import MODES, Case, measure

BASELINE = "sdpa[FLASH_ATTENTION]"
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
COLUMNS = ("series", "n", "mode", "time", "tokens", "peak", "speedup", "ideal")


@dataclasses.dataclass(frozen=True)
class GpuPreset:
    """The GPU comparison: every series at every (dtype, head dim, N, mode)."""

    batch: int = 1
    heads: int = 8
    head_dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("bfloat16", "float16")
    lengths: tuple[int, ...] = (1024, 4096, 16384, 65536, 131072)
    modes: tuple[str, ...] = MODES
    mita: tuple[tuple[str, int], ...] = (("num_landmarks", 64), ("topk", 64), ("num_routed", 1))
    budget_s: float = 0.05  # timed seconds per point (the preset's estimate: docs/performance.md)
    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 100
    memory: bool = True


GPU_PRESET = GpuPreset()


def series_ops(mita_options: dict[str, int]) -> dict[str, tuple[str, str, Callable[..., torch.Tensor]]]:
    """label -> (method, options text, op(q, k, v)) of every series this machine can run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend: str) -> Callable[..., torch.Tensor]:
        def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return F.scaled_dot_product_attention(q, k, v)

        return op

    def mita(impl: str) -> Callable[..., torch.Tensor]:
        return lambda q, k, v: mita_attention(q, k, v, impl=impl, **mita_options)

    opts = ",".join(f"{k}={v}" for k, v in mita_options.items())
    ops = {f"sdpa[{b}]": ("sdpa", f"backend={b}", sdpa(b)) for b in SDPA_BACKENDS}
    ops["mita[triton]"] = ("mita", f"impl=triton,{opts}", mita("triton"))
    ops["mita[grouped]"] = ("mita", f"impl=grouped,{opts}", mita("grouped"))
    if importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_func  # (B, N, H, D) layout: a transposed view, no copy

        def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

        ops["flash_attn_func"] = ("flash_attn", "", flash)
    return ops


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """A checked GPU run: the preset with the user's overrides."""

    preset: GpuPreset
    device: str
    out: str | None
    force: bool


def make_gpu_plan(args: argparse.Namespace) -> GpuPlan:
    """The plan of ``mita bench --device cuda`` / ``--preset gpu``; refuses what it cannot run, before anything runs."""
    if not str(args.device).startswith("cuda"):
        raise ValueError(f"--preset gpu measures on a GPU: pass --device cuda (got --device {args.device})")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine; run this on a GPU machine")
    unsupported = {"--resume": args.resume, "--sweep": args.sweep, "--max-n-per-method": args.max_n_per_method}
    for flag, value in unsupported.items():
        if value:
            raise ValueError(f"{flag} is not supported by the GPU comparison (--device cuda without --methods)")
    if args.lengths and min(args.lengths) < 1:
        raise ValueError(f"--lengths must be positive, got {args.lengths}")
    for name in ("batch", "heads", "head_dim", "min_repeats"):
        if (value := getattr(args, name)) is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.dtype is not None and args.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype {args.dtype}: the GPU comparison runs bfloat16, float16 or float32")
    base = GPU_PRESET
    preset = dataclasses.replace(
        base,
        batch=args.batch or base.batch,
        heads=args.heads or base.heads,
        head_dims=(args.head_dim,) if args.head_dim else base.head_dims,
        dtypes=(args.dtype,) if args.dtype else base.dtypes,
        lengths=tuple(args.lengths) if args.lengths else base.lengths,
        modes=tuple(dict.fromkeys(args.modes)) if args.modes else base.modes,
        budget_s=base.budget_s if args.budget is None else args.budget,
        warmup=args.warmup,
        min_repeats=args.min_repeats,
        max_repeats=args.max_repeats,
        memory=not args.no_memory,
    )
    if preset.budget_s < 0 or preset.warmup < 0 or preset.max_repeats < preset.min_repeats:
        raise ValueError("--budget and --warmup must be >= 0, and --max-repeats >= --min-repeats")
    return GpuPlan(preset, args.device, args.out, args.force)


def gpu_row(label: str, method: str, options: str, case: Case, mode: str, session: str, mita_opts: dict) -> Row:
    """The row of a point before it is measured (the columns of :data:`mita_experiments.benchmarks.report.FIELDS`)."""
    per_head = mita_flops(case.n, case.head_dim, **mita_opts) if method == "mita" else 4.0 * case.n**2 * case.head_dim
    return point_row(session, case, label, method, options, mode, per_head)


def run_gpu(args: argparse.Namespace, prepare_out_dir: Callable[..., Path]) -> int:
    """Run the GPU comparison; 1 if a MiTA point failed (a baseline that cannot run is only reported)."""
    plan = make_gpu_plan(args)
    p = plan.preset
    out_dir = prepare_out_dir(plan.out, force=plan.force, resume=False)
    session = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    info = {
        "machine": machine_info(plan.device),
        "sessions": [session_info(session, command_line(args))],
        "preset": str(p),
    }
    (out_dir / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    mita_opts = dict(p.mita)
    ops = series_ops(mita_opts)
    rows: list[Row] = []
    write_rows(out_dir / "results.csv", [])
    log = CsvLog(out_dir / "results.csv")
    failures = 0
    try:
        for dtype in p.dtypes:
            for head_dim in p.head_dims:
                for n in p.lengths:
                    for mode in p.modes:
                        case = Case(p.batch, p.heads, n, head_dim, dtype, plan.device)
                        base = None
                        for label, (method, options, op) in ops.items():
                            row = gpu_row(label, method, options, case, mode, session, mita_opts)
                            row = _measure(row, op, case, mode, p)
                            base = row if label == BASELINE else base
                            row = add_ratios(row, base)
                            failures += method == "mita" and row["status"] != OK
                            rows.append(row)
                            log.write(row)
                            print(progress_line(_point(row), row, 9, 3), flush=True)
    finally:
        log.close()
    write_rows(out_dir / "results.csv", rows)
    (out_dir / "results.md").write_text(gpu_markdown(rows, info))
    print(f"mita bench: results in {out_dir}/ (results.csv, results.md)")
    return 1 if failures else 0


def _measure(row: Row, op: Callable, case: Case, mode: str, p: GpuPreset) -> Row:
    try:
        m = measure(
            op,
            case,
            mode,
            budget_s=p.budget_s,
            warmup=p.warmup,
            min_repeats=p.min_repeats,
            max_repeats=p.max_repeats,
            memory=p.memory,
        )
    except Exception as err:  # a backend this GPU or build lacks, out of memory: reported, the run goes on
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        message = str(err).splitlines()[0][:160] if str(err) else ""
        return {**row, "status": f"failed: {type(err).__name__}: {message}"}
    return measured_row(row, m, case.batch * case.n)


def _point(row: Row) -> str:
    return f"{row['dtype']:<8} D={row['head_dim']:<3} N={row['n']:>6} {row['mode']:<6} {row['series']:<26}"


def gpu_markdown(rows: Sequence[Row], info: dict) -> str:
    """results.md: the machine, the command, then one table per (dtype, head dim)."""
    m = info["machine"]
    lines = [
        "# mita bench --device cuda",
        "",
        f"GPU: {m.get('cuda_device')}, CUDA {m.get('cuda_version')}, torch {m.get('torch')}, CPU {m.get('cpu_model')}.",
        "",
        *(f"- `{s['command']}` (started {s['started_utc']})" for s in info["sessions"]),
        "",
        f"Median time per call; speed-up over `{BASELINE}` at the same point, measured in the same process; "
        "ideal is the FLOP model's (spec section 3). Peak: CUDA memory of one call with its inputs.",
        "",
    ]
    groups = dict.fromkeys((r["dtype"], r["head_dim"]) for r in rows)
    for dtype, head_dim in groups:
        part = [r for r in rows if (r["dtype"], r["head_dim"]) == (dtype, head_dim)]
        r0 = part[0]
        lines += [f"## {dtype}, D = {head_dim} (B = {r0['batch']}, H = {r0['heads']})", ""]
        lines += [markdown_table(part, COLUMNS), ""]
    return "\n".join(lines)


def wants_gpu(args: argparse.Namespace) -> bool:
    """Whether ``mita bench`` runs the GPU comparison: ``--preset gpu``, or ``--device cuda`` without ``--methods``."""
    return args.preset == "gpu" or (str(args.device).startswith("cuda") and not args.methods and args.preset is None)
