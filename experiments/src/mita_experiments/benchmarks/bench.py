"""``mita bench [op]``: time, throughput and peak memory of every registered attention against N.

Methods come from the registry (:mod:`mita.attention`), so a newly registered method is
benchmarked with no change here. Each point (method, options, N, mode) is measured by
:func:`mita_experiments.benchmarks.timing.measure` and compared with the baseline (SDPA) measured at
the same shape in the same run. Results go to an output folder: ``results.csv`` (every
measurement, appended as it is taken so ``--resume`` can continue an interrupted run),
``results.md``, ``time.png``, ``speedup.png``, ``memory.png`` and ``machine.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import itertools
import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mita import attention
from mita.utils.options import parse_assignments, parse_value, split_items

from ..utils.files import prepare_output_dir
from ..utils.machine import machine_info
from . import gpu
from .report import (
    OK,
    OTHER_SESSION,
    CsvLog,
    Row,
    add_ratios,
    command_line,
    crossovers,
    from_other_session,
    markdown_table,
    measured_row,
    plot,
    point_row,
    progress_line,
    read_rows,
    session_info,
    write_rows,
)
from .timing import (
    DTYPES,
    MODES,
    Case,
    Measurement,
    matmul_rate,
    measure,
    measure_side_by_side,
    op_profile,
    torch_threads,
)

OUTPUTS = ("results.csv", "results.md", "time.png", "speedup.png", "memory.png", "machine.json")


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named benchmark: the shapes, the lengths and the options it gives every method that takes them."""

    batch: int
    heads: int
    head_dim: int
    lengths: tuple[int, ...]
    options: Mapping[str, Any]
    per_length: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)  # extra options at one length
    fixed_lengths: bool = False  # --lengths does not apply
    budget_s: float = 1.0
    rounds: int | None = None  # side by side in this many rounds unless --rounds says otherwise

    def options_at(self, n: int) -> dict[str, Any]:
        return {**self.options, **self.per_length.get(n, {})}


PRESETS = {
    # spec section 4: B=1, H=8, D=64, float32, m=k=64, s=1, N from 1,024 to 65,536
    "standard": Preset(
        1, 8, 64, tuple(2**i for i in range(10, 17)), {"num_landmarks": 64, "topk": 64, "num_routed": 1}
    ),
    # DeiT at 224 px (1 CLS token + 14x14 patches, m=k=25) and segmentation at 512 px (1 + 32x32, m=k=49)
    "vision": Preset(
        batch=1,
        heads=8,
        head_dim=64,
        lengths=(197, 1025),
        options={"num_routed": 1, "num_prefix_tokens": 1},
        per_length={
            197: {"num_landmarks": 25, "topk": 25, "grid": (14, 14)},
            1025: {"num_landmarks": 49, "topk": 49, "grid": (32, 32)},
        },
        fixed_lengths=True,
    ),
    # issue 11's op targets, DeiT-S's attention with its batch: 224 px (B = 16, N = 197) and 512 px (B = 4, N = 1,025)
    # (side by side in 41 rounds: ratios meant for targets)
    "deit224": Preset(
        16,
        6,
        64,
        (197,),
        {"num_landmarks": 25, "topk": 25, "grid": (14, 14), "num_routed": 1, "num_prefix_tokens": 1},
        fixed_lengths=True,
        rounds=41,
    ),
    "deit512": Preset(
        4,
        6,
        64,
        (1025,),
        {"num_landmarks": 49, "topk": 49, "grid": (32, 32), "num_routed": 1, "num_prefix_tokens": 1},
        fixed_lengths=True,
        rounds=41,
    ),
    # video (VideoMAE-base: 12 heads of 64): 16 frames at 224 px in 2x16x16 tubelets, an (8, 14, 14) grid of
    # N = 1,568 tokens, and 32 frames, (16, 14, 14), N = 3,136; m = k = 98 on a (2, 7, 7) landmark grid
    "video": Preset(
        batch=1,
        heads=12,
        head_dim=64,
        lengths=(1568, 3136),
        options={"num_landmarks": (2, 7, 7), "topk": 98, "num_routed": 1, "num_prefix_tokens": 0},
        per_length={1568: {"grid": (8, 14, 14)}, 3136: {"grid": (16, 14, 14)}},
        fixed_lengths=True,
    ),
    # a smoke run for CI: tiny shapes, a few seconds in all
    "quick": Preset(1, 2, 16, (128, 256), {"num_landmarks": 8, "topk": 8, "num_routed": 1}, budget_s=0.01),
}


@dataclasses.dataclass(frozen=True)
class Series:
    """One line of the plots: a registered method with the options the user gave it (config and sweep)."""

    label: str
    method: attention.Method
    options: Mapping[str, Any]

    def options_at(self, preset: Preset, n: int) -> dict[str, Any]:
        """The call's options: the method's defaults < the preset's (those it takes) < the user's."""
        from_preset = {k: v for k, v in preset.options_at(n).items() if accepts(self.method, k)}
        return {**self.method.defaults, **from_preset, **self.options}


@dataclasses.dataclass(frozen=True)
class Settings:
    """How each point is measured (see :func:`mita_experiments.benchmarks.timing.measure`)."""

    budget_s: float = 1.0
    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 100
    memory: bool = True
    seed: int = 0
    profile_dir: Path | None = None  # if set, an op profile of every point is written there
    rounds: int | None = None  # if set, the methods of each (N, mode) are timed in this many alternating rounds
    matmul_gflops: float | None = None  # the machine's matmul rate in the run's dtype (timing.matmul_rate)


def accepts(method: attention.Method, key: str) -> bool:
    """Whether the method's op takes the keyword option ``key``."""
    params = inspect.signature(method.op).parameters
    return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def format_options(options: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v!r}" for k, v in sorted(options.items()))


def make_series(config: str, sweep: Mapping[str, Any] | None = None) -> Series:
    """The series of a config like ``mita:topk=32``, with sweep values for the options the method takes."""
    name, options = attention.parse(config)
    method = attention.get(name)  # the registry's error lists the valid names
    for key in options:
        if not accepts(method, key):
            valid = [p for p in inspect.signature(method.op).parameters if p not in ("q", "k", "v")]
            raise ValueError(f"{key!r} in {config!r} is not an option of {name!r}; its options: {', '.join(valid)}")
    options.update({k: v for k, v in (sweep or {}).items() if accepts(method, k)})
    label = name + (":" + format_options(options) if options else "")
    return Series(label, method, options)


def expand_series(configs: Sequence[str], baseline: str, sweeps: Mapping[str, Sequence[Any]]) -> list[Series]:
    """The baseline first, then every config once per combination of the sweep values it takes."""
    for key in sweeps:
        if not any(accepts(attention.get(attention.parse(c)[0]), key) for c in configs):
            raise ValueError(f"--sweep {key}: none of the methods {list(configs)} takes the option {key!r}")
    combos = [dict(zip(sweeps, values)) for values in itertools.product(*sweeps.values())]
    series = {}
    for s in [make_series(baseline), *(make_series(c, combo) for c in configs for combo in combos)]:
        series.setdefault(s.label, s)
    return list(series.values())


def parse_sweeps(items: Sequence[str]) -> dict[str, list[Any]]:
    """``--sweep topk=16,32,64`` into ``{"topk": [16, 32, 64]}`` (commas inside brackets do not split)."""
    sweeps = {}
    for key, values in parse_assignments(items, "--sweep", typed=False).items():
        sweeps[key] = [parse_value(v) for v in split_items(values)]
        if not sweeps[key]:
            raise ValueError(f"--sweep {key}= gives no values; write KEY=V1,V2,...")
    return sweeps


def parse_caps(items: Sequence[str]) -> dict[str, int]:
    """``--max-n-per-method sdpa=16384`` into ``{"sdpa": 16384}``; names must be registered."""
    caps = parse_assignments(items, "--max-n-per-method")
    for name, value in caps.items():
        attention.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--max-n-per-method {name}={value}: the cap must be a whole number of tokens")
    return caps


def new_row(series: Series, options: Mapping[str, Any], case: Case, mode: str, session: str) -> Row:
    """The row of a point before it is measured: what, where, and the options of the call."""
    flops = attention.flops({"name": series.method.name, **options}, case.n, case.head_dim)
    return point_row(session, case, series.label, series.method.name, format_options(options), mode, flops)


def measure_row(row: Row, options: Mapping[str, Any], case: Case, settings: Settings) -> Row:
    """Measure the point of ``row`` (made by :func:`new_row`); the ratios to the baseline are not set."""
    op = attention.build_op({"name": row["method"], **options})
    m = measure(
        op,
        case,
        row["mode"],
        budget_s=settings.budget_s,
        warmup=settings.warmup,
        min_repeats=settings.min_repeats,
        max_repeats=settings.max_repeats,
        memory=settings.memory,
        seed=settings.seed,
    )
    return _finish(row, op, m, case, settings)


def measure_rows(points: Sequence[tuple[Row, Mapping[str, Any]]], case: Case, settings: Settings) -> list[Row]:
    """Measure several points of one (N, mode) side by side (``settings.rounds`` alternating rounds);
    a method that fails gets its row marked failed, the others are measured."""
    ops = {row["series"]: attention.build_op({"name": row["method"], **options}) for row, options in points}
    mode = points[0][0]["mode"]
    results = measure_side_by_side(
        ops, case, mode, settings.rounds, warmup=max(1, settings.warmup), memory=settings.memory, seed=settings.seed
    )
    return [
        _failed(row, m)
        if isinstance(m := results[row["series"]], Exception)
        else _finish(row, ops[row["series"]], m, case, settings)
        for row, _ in points
    ]


def _finish(row: Row, op: Any, m: Measurement, case: Case, settings: Settings) -> Row:
    """The measured row, and the op profile of the point when asked for."""
    if settings.profile_dir is not None:
        name = re.sub(r"[^\w.=-]+", "_", f"{row['series']}-N{case.n}-{row['mode']}") + ".txt"
        settings.profile_dir.mkdir(exist_ok=True)
        (settings.profile_dir / name).write_text(op_profile(op, case, row["mode"], seed=settings.seed))
    return measured_row(row, m, case.batch * case.n, settings.matmul_gflops)


def _failed(row: Row, err: Exception) -> Row:
    message = str(err).splitlines()[0][:200] if str(err) else ""
    return {**row, "status": f"failed: {type(err).__name__}: {message}"}


def _key(row: Row) -> tuple[str, ...]:
    return tuple(row[f] for f in ("device", "dtype", "batch", "heads", "head_dim", "series", "options", "n", "mode"))


def prepare_out_dir(out: str | None, *, force: bool, resume: bool) -> Path:
    """The output folder: refuses a non-empty one unless ``force`` (overwrite) or ``resume`` (continue)."""
    if out is None:
        if resume:
            raise ValueError("--resume needs --out DIR, the folder of the run to continue")
        path = Path("bench-results") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        while path.exists():
            path = path.with_name(path.name + "+")
    else:
        path = Path(out)
    if resume and not (path / "results.csv").is_file():
        raise FileNotFoundError(f"--resume: {path / 'results.csv'} does not exist; run without --resume first")
    path = prepare_output_dir(path, force=force, reuse=resume)
    if force:  # no stale plot or table of the run being replaced; other files are left alone
        for file in [*(path / name for name in OUTPUTS), *(path / "profiles").glob("*.txt")]:
            file.unlink(missing_ok=True)
    return path


def record_machine(
    path: Path, device: str, session: str, command: str, *, resume: bool, rate: float | None = None
) -> None:
    """Write machine.json (with this session's matmul ``rate`` in GFLOP/s); a resumed run must be on the
    same machine, threads and torch."""
    info = {"machine": machine_info(device), "sessions": [{**session_info(session, command), "matmul_gflops": rate}]}
    if resume and path.exists():
        old = json.loads(path.read_text())
        if old.get("machine") != info["machine"]:
            raise ValueError(
                f"--resume: this machine or setup differs from the one in {path} "
                f"({old.get('machine')} vs {info['machine']}); start a new folder instead of mixing them"
            )
        info["sessions"] = [*old.get("sessions", []), *info["sessions"]]
    path.write_text(json.dumps(info, indent=2) + "\n")


DRIFT = 0.2  # a change of the machine's matmul rate over a run above which results.md warns


def record_rate_at_end(path: Path, rate: float) -> None:
    """Add the matmul rate measured after the run's points to this session in machine.json: on a shared
    VM the machine's speed can move by a third within minutes, and the two rates show whether it did."""
    info = json.loads(path.read_text())
    info["sessions"][-1]["matmul_gflops_end"] = rate
    path.write_text(json.dumps(info, indent=2) + "\n")


def record_kernel(path: Path) -> None:
    """Add what MiTA's fused CPU kernel decided for this machine (``fused.kernel_choices``: bfloat16
    products, the read-ahead) to this session in machine.json, when a point loaded it."""
    from mita.ops.mita import fused

    if (choices := fused.kernel_choices()) is not None:
        info = json.loads(path.read_text())
        info["sessions"][-1]["mita_cpu_kernel"] = choices
        path.write_text(json.dumps(info, indent=2) + "\n")


def _kernel(session: Mapping[str, Any]) -> str | None:
    """The sentence of results.md on the fused CPU kernel's choices in ``session``, if recorded."""
    if not (choices := session.get("mita_cpu_kernel")):
        return None
    said = ", ".join(f"{name.replace('_', ' ')} {'on' if on else 'off'}" for name, on in choices.items())
    return f"MiTA's fused CPU kernel, as it decided on this machine: {said} (`mita.ops.mita.fused.kernel_choices`)."


def _rates(session: Mapping[str, Any]) -> str:
    """A session's matmul rate in GFLOP/s, and the one at its end where measured."""
    end = session.get("matmul_gflops_end")
    return f"{session['matmul_gflops']:.0f}" + (f" at the start, {end:.0f} at the end" if end else "")


def rate_drift(session: Mapping[str, Any]) -> str | None:
    """A sentence on a session whose matmul rate moved by more than ``DRIFT`` between start and end, else None."""
    start, end = session.get("matmul_gflops"), session.get("matmul_gflops_end")
    if not start or not end or abs(end / start - 1) <= DRIFT:
        return None
    return (
        f"The machine's matmul rate moved from {start:.0f} to {end:.0f} GFLOP/s during `{session['command']}`: "
        "absolute times of that run are unreliable; ratios measured side by side (`--rounds`) hold better."
    )


HELP = "the attention ops against sequence length: time, throughput and peak memory (the default target)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mita bench [op]`` (registered by :mod:`mita_experiments.benchmarks.cli`)."""
    p.add_argument("--methods", nargs="+", metavar="CONFIG", help="configs like mita 'mita:topk=32' (default: all)")
    p.add_argument(
        "--preset",
        choices=sorted([*PRESETS, "gpu"]),
        help="shapes and options (default: standard; 'gpu': MiTA against SDPA's backends on a GPU)",
    )
    p.add_argument("--quick", action="store_true", help="the 'quick' preset: a smoke run of a few seconds")
    p.add_argument("--lengths", type=int, nargs="+", metavar="N", help="sequence lengths (default: the preset's)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="forward, forward+backward")
    p.add_argument("--sweep", nargs="+", default=[], metavar="KEY=V1,V2", help="e.g. topk=16,32,64 (product)")
    p.add_argument("--max-n-per-method", nargs="+", default=[], metavar="NAME=N", help="e.g. sdpa=16384")
    p.add_argument("--baseline", default="sdpa", metavar="CONFIG", help="the method ratios are taken to")
    p.add_argument("--batch", type=int, help="B (default: the preset's)")
    p.add_argument("--heads", type=int, help="H (default: the preset's)")
    p.add_argument("--head-dim", type=int, help="D (default: the preset's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 (the GPU comparison: bfloat16, float16)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cuda without --methods: the GPU comparison)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")
    p.add_argument("--budget", type=float, help="seconds of timed calls per point (default: the preset's)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before measuring")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--max-repeats", type=int, default=100)
    p.add_argument(
        "--rounds",
        type=int,
        metavar="R",
        help="time the methods of each (N, mode) side by side, one call of each per round, R rounds "
        "(instead of each alone for --budget seconds): ratios that hold on a machine whose speed drifts "
        "(default: the preset's; 41 for deit224 and deit512, else off)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the (untimed) peak memory call")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--profile", action="store_true", help="also write an op profile of each point to DIR/profiles/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="DIR", help="output folder (default: bench-results/<date-time>)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--force", action="store_true", help="overwrite the results in a non-empty --out")
    g.add_argument("--resume", action="store_true", help="continue the run in --out, skipping measured points")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked benchmark: what to measure (series x lengths x modes) and how."""

    preset: Preset
    series: list[Series]  # the baseline first
    lengths: tuple[int, ...]
    modes: tuple[str, ...]
    shape: Mapping[str, int]  # batch, heads, head_dim
    caps: Mapping[str, int]
    settings: Settings


def make_plan(args: argparse.Namespace) -> Plan:
    """Check every argument before anything is measured or written."""
    if args.quick and args.preset not in (None, "quick"):
        raise ValueError(f"--quick is the 'quick' preset; it cannot be combined with --preset {args.preset}")
    preset_name = "quick" if args.quick else args.preset or "standard"
    preset = PRESETS[preset_name]
    if args.lengths and preset.fixed_lengths:
        raise ValueError(f"the {preset_name!r} preset has fixed lengths {preset.lengths}; drop --lengths")
    _positive(args, "batch", "heads", "head_dim", "threads", "max_repeats", "min_repeats", "rounds")
    if args.lengths and min(args.lengths) < 1:
        raise ValueError(f"--lengths must be positive, got {args.lengths}")
    if not args.device.startswith(("cpu", "cuda")):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available on this machine")
    settings = Settings(
        budget_s=preset.budget_s if args.budget is None else args.budget,
        warmup=args.warmup,
        min_repeats=args.min_repeats,
        max_repeats=args.max_repeats,
        memory=not args.no_memory,
        seed=args.seed,
        rounds=preset.rounds if args.rounds is None else args.rounds,
    )
    if settings.budget_s < 0 or settings.warmup < 0 or settings.max_repeats < settings.min_repeats:
        raise ValueError("--budget and --warmup must be >= 0, and --max-repeats >= --min-repeats")
    return Plan(
        preset=preset,
        series=expand_series(args.methods or attention.names(), args.baseline, parse_sweeps(args.sweep)),
        lengths=tuple(args.lengths or preset.lengths),
        modes=tuple(dict.fromkeys(args.modes)),
        shape={k: getattr(args, k) or getattr(preset, k) for k in ("batch", "heads", "head_dim")},
        caps=parse_caps(args.max_n_per_method),
        settings=settings,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the arguments describe; 1 if a point failed, else 0."""
    if gpu.wants_gpu(args):
        return gpu.run_gpu(args, prepare_out_dir)
    plan = make_plan(args)
    out_dir = prepare_out_dir(args.out, force=args.force, resume=args.resume)
    if args.profile:
        plan = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, profile_dir=out_dir / "profiles"))
    with torch_threads(args.threads):
        session = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
        rate = matmul_rate(args.dtype or "float32", args.device)
        plan = dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, matmul_gflops=rate))
        record_machine(
            out_dir / "machine.json", args.device, session, command_line(args), resume=args.resume, rate=rate
        )
        rows = {_key(r): r for r in read_rows(out_dir / "results.csv")} if args.resume else {}
        write_rows(out_dir / "results.csv", rows.values())  # a new file, or the resumed one rid of a cut line
        failures = _measure_all(plan, args.dtype or "float32", args.device, session, rows, out_dir / "results.csv")
        record_rate_at_end(out_dir / "machine.json", matmul_rate(args.dtype or "float32", args.device))
        record_kernel(out_dir / "machine.json")
    # ratios again over all rows: a resumed run may have measured a baseline after the rows that need it
    final = [
        add_ratios(r, rows.get(_baseline_key(plan, r)))
        for r in sorted(rows.values(), key=lambda r: (int(r["n"]), MODES.index(r["mode"]), _order(plan.series, r)))
    ]
    write_rows(out_dir / "results.csv", final)
    _write_reports(final, out_dir, plan.series[0].label, plots=not args.no_plots)
    print(f"mita bench: results in {out_dir}/ (results.csv, results.md{', *.png' if not args.no_plots else ''})")
    if failures:
        print(f"mita bench: {failures} point(s) failed; see the status column")
    return 1 if failures else 0


def _measure_all(
    plan: Plan, dtype: str, device: str, session: str, rows: dict[tuple[str, ...], Row], csv_path: Path
) -> int:
    """Measure every point of the plan not in ``rows`` already, appending each row to the CSV; the failures."""
    from tqdm import tqdm

    failures = 0
    log = CsvLog(csv_path)
    total = len(plan.lengths) * len(plan.modes) * len(plan.series)
    bar = tqdm(total=total, desc="mita bench", unit="point", dynamic_ncols=True)
    try:
        for n, mode in itertools.product(plan.lengths, plan.modes):
            case = Case(plan.shape["batch"], plan.shape["heads"], n, plan.shape["head_dim"], dtype, device)
            todo, capped = [], []
            for s in plan.series:
                options = s.options_at(plan.preset, n)
                row = new_row(s, options, case, mode, session)
                cap = plan.caps.get(row["method"])
                if (old := rows.get(_key(row))) is not None and old["status"] == OK:
                    bar.update()  # measured by the run being resumed
                elif cap is not None and n > cap:
                    capped.append({**row, "status": f"not measured (N > {cap}, --max-n-per-method)"})
                else:
                    todo.append((row, options))
            for row in itertools.chain(capped, _measured(todo, case, plan.settings, bar)):
                row = rows[_key(row)] = add_ratios(row, rows.get(_baseline_key(plan, row)))
                failures += row["status"].startswith("failed")
                log.write(row)
                bar.write(progress_line(f"{row['series']:<24} N={row['n']:>6} {row['mode']:<6}", row))
                bar.update()
    finally:
        bar.close()
        log.close()
    return failures


def _measured(points: list[tuple[Row, Mapping[str, Any]]], case: Case, settings: Settings, bar: Any) -> Iterator[Row]:
    """The rows of one (N, mode)'s points as they are measured: all at once side by side with
    ``settings.rounds``, else one by one. A method that fails at a point (e.g. out of memory) gets its
    row marked failed and the run goes on."""
    groups = [points] if settings.rounds and points else [[p] for p in points]
    for group in groups:
        bar.set_postfix_str(", ".join(row["series"] for row, _ in group) + f" N={case.n} {group[0][0]['mode']}")
        try:
            if settings.rounds:
                yield from measure_rows(group, case, settings)
            else:
                yield measure_row(*group[0], case, settings)
        except Exception as err:
            yield from (_failed(row, err) for row, _ in group)


def _baseline_key(plan: Plan, row: Row) -> tuple[str, ...]:
    """The key of the baseline's row at the shape, length and mode of ``row``."""
    base = plan.series[0]
    return _key({**row, "series": base.label, "options": format_options(base.options_at(plan.preset, int(row["n"])))})


def _order(series: Sequence[Series], row: Row) -> int:
    labels = [s.label for s in series]
    return labels.index(row["series"]) if row["series"] in labels else len(labels)


def _write_reports(rows: Sequence[Row], out_dir: Path, baseline: str, *, plots: bool) -> None:
    """results.md (the machine, the commands, the table) and the plots."""
    machine = json.loads((out_dir / "machine.json").read_text())
    info, sessions = machine["machine"], machine["sessions"]
    gpu = f", {info['cuda_device']}" if info["cuda_device"] else ""
    rates = ", ".join(_rates(s) for s in sessions if s.get("matmul_gflops")) or "not measured"
    lines = [
        "# mita bench",
        "",
        f"Machine: {info['cpu_model']}, {info['usable_cpus']} usable CPUs, {info['torch_threads']} torch threads, "
        f"torch {info['torch']}{gpu}, device {info['device']}, memory: {info.get('memory', 'not recorded')}.",
        "",
        *(f"- `{s['command']}` (started {s['started_utc']}, load average {s['load_average']})" for s in sessions),
        "",
        f"Speed-ups are over `{baseline}` at the same shape, measured in the same process; "
        "ideal is the FLOP model's (spec section 3). GFLOP/s are the FLOP model's per second (forward+backward "
        "as 3 forwards); of matmul is their share of this machine's square matmul rate in the same dtype "
        f"and threads ({rates} GFLOP/s).",
        "",
        *([kernel, ""] if (kernel := _kernel(sessions[-1])) else []),
        markdown_table(rows),
    ]
    if any(map(from_other_session, rows)):
        lines.append(OTHER_SESSION + "\n")
    lines += [f"{warning}\n" for warning in map(rate_drift, sessions) if warning]
    if crossings := crossovers(rows, baseline):
        lines += [f"Crossover with `{baseline}`:", "", *crossings, ""]
    (out_dir / "results.md").write_text("\n".join(lines))
    if not plots:
        return
    try:
        plot(rows, out_dir, baseline)
    except ImportError:
        print("mita bench: plots skipped: matplotlib is not installed (pip install 'mita[plot]')")
