"""The benchmark suite: ``mita bench`` outputs, ratios, overwrite and resume rules, memory, ``mita demo``."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
import torch

from mita import attention
from mita_experiments.benchmarks import bench, report, timing
from mita_experiments.cli import build_parser, main

QUICK = ["bench", "--quick", "--threads", "1", "--methods", "mita", "sdpa"]
TINY = ["bench", "--quick", "--threads", "1", "--methods", "sdpa", "--modes", "fwd", "--no-plots"]
MIB = 2**20


def rows_of(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "quick"
    assert main([*QUICK, "--out", str(out)]) == 0
    return out


def test_quick_writes_csv_markdown_plots_and_machine(quick_run: Path) -> None:
    rows = rows_of(quick_run)
    assert {(r["series"], int(r["n"]), r["mode"]) for r in rows} == {
        (s, n, mode) for s in ("sdpa", "mita") for n in (128, 256) for mode in ("fwd", "fwdbwd")
    }
    assert all(r["status"] == "ok" and int(r["repeats"]) >= 1 and float(r["median_s"]) > 0 for r in rows)
    table = (quick_run / "results.md").read_text()
    assert table.count("\n| mita |") == table.count("\n| sdpa |") == 4
    for name in ("time.png", "speedup.png", "memory.png"):
        assert (quick_run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    machine = json.loads((quick_run / "machine.json").read_text())
    assert machine["machine"]["torch"] == torch.__version__
    assert machine["machine"]["torch_threads"] == 1
    assert {"cpu_model", "logical_cpus", "usable_cpus"} <= set(machine["machine"])
    assert machine["sessions"][0]["session"] == rows[0]["session"]


def test_quick_rows_ratios_follow_their_definitions(quick_run: Path) -> None:
    rows = rows_of(quick_run)
    sdpa = {(r["n"], r["mode"]): r for r in rows if r["method"] == "sdpa"}
    rate = json.loads((quick_run / "machine.json").read_text())["sessions"][0]["matmul_gflops"]
    for r in rows:
        n, t, T = int(r["n"]), float(r["median_s"]), 1 * 2 * int(r["n"]) * 16 * 4  # B H N D float32
        assert float(r["reference_bytes"]) == (4 if r["mode"] == "fwd" else 8) * T
        assert float(r["memory_ratio"]) == pytest.approx(float(r["peak_bytes"]) / float(r["reference_bytes"]), 1e-4)
        assert float(r["tokens_per_s"]) == pytest.approx(n / t, 1e-4)
        base = sdpa[r["n"], r["mode"]]
        assert float(r["speedup"]) == pytest.approx(float(base["median_s"]) / t, 1e-4)
        ideal = 1.0 if r["method"] == "sdpa" else n / (2 * 8 + 8)  # N / (2m + sk), m = k = 8 in --quick
        assert float(r["ideal_speedup"]) == pytest.approx(ideal, 1e-4)
        assert float(r["fraction_of_ideal"]) == pytest.approx(float(r["speedup"]) / ideal, 1e-4)
        passes = {"fwd": 1, "fwdbwd": 3}[r["mode"]]
        assert float(r["gflops_per_s"]) == pytest.approx(float(r["model_flops"]) * passes / t / 1e9, 1e-4)
        assert float(r["matmul_gflops_per_s"]) == pytest.approx(rate, 1e-4)
        assert float(r["share_of_matmul"]) == pytest.approx(float(r["gflops_per_s"]) / rate, 1e-4)
        assert float(r["page_faults"]) >= 0 or timing.resource is None  # (empty where not counted)
    assert "of matmul" in (quick_run / "results.md").read_text()


def test_the_fused_kernels_choices_are_recorded(quick_run: Path) -> None:
    """What MiTA's CPU kernel decided on this machine (bfloat16 products, the read-ahead) is in
    machine.json and results.md when the run used it."""
    from mita.ops.mita import fused

    session = json.loads((quick_run / "machine.json").read_text())["sessions"][0]
    if not fused.available():
        assert "mita_cpu_kernel" not in session
        return
    assert session["mita_cpu_kernel"] == fused.kernel_choices()
    assert set(session["mita_cpu_kernel"]) == {"bf16_products", "read_ahead"}
    assert "read ahead o" in (quick_run / "results.md").read_text()


def test_the_matmul_rate_is_measured_again_at_the_end_and_a_drift_is_reported(quick_run: Path) -> None:
    session = json.loads((quick_run / "machine.json").read_text())["sessions"][0]
    assert session["matmul_gflops_end"] > 0
    assert "at the start," in (quick_run / "results.md").read_text()
    steady = {"command": "mita bench", "matmul_gflops": 100.0, "matmul_gflops_end": 100.0 * (1 + bench.DRIFT)}
    assert bench.rate_drift(steady) is None
    assert bench.rate_drift({k: v for k, v in steady.items() if k != "matmul_gflops_end"}) is None  # older runs
    moved = bench.rate_drift({**steady, "matmul_gflops_end": 60.0})
    assert moved is not None and "from 100 to 60 GFLOP/s" in moved and "`mita bench`" in moved


def test_matmul_rate_is_a_rate_and_checks_its_arguments() -> None:
    assert 0.01 < timing.matmul_rate("float32", size=64, repeats=3) < 1e6  # GFLOP/s of a 64^3 product
    start = time.perf_counter()
    assert timing.matmul_rate("bfloat16", repeats=2) > 0  # slow without bf16 hardware: the size stays small
    assert time.perf_counter() - start < 30
    with pytest.raises(ValueError, match="matmul_rate needs dtype"):
        timing.matmul_rate("int8")
    with pytest.raises(ValueError, match="size >= 1"):
        timing.matmul_rate("float32", size=0)


def test_ratios_arithmetic() -> None:
    assert report.ratios(2.0, 10.0, 1e6, 8e7) == {"speedup": "5", "ideal_speedup": "80", "fraction_of_ideal": "0.0625"}
    assert report.ratios(2.0, None, 1e6, 8e7) == {"speedup": "", "ideal_speedup": "80", "fraction_of_ideal": ""}
    assert report.ratios(2.0, 4.0, None, 8e7) == {"speedup": "2", "ideal_speedup": "", "fraction_of_ideal": ""}


@pytest.mark.parametrize(("n", "ideal"), [(16384, 16384 / 192), (65536, 65536 / 192)], ids=["N=16384", "N=65536"])
def test_ideal_speedup_of_the_standard_config(n: int, ideal: float) -> None:
    mita = bench.make_series("mita")
    options = mita.options_at(bench.PRESETS["standard"], n)
    ratio = attention.flops("sdpa", n, 64) / attention.flops({"name": "mita", **options}, n, 64)
    assert ratio == pytest.approx(ideal)  # spec section 3: N / (2m + sk) = 85x and 341x


def test_refuses_to_overwrite_a_non_empty_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main([*TINY, "--lengths", "32", "--out", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    (tmp_path / "time.png").write_text("an old plot")
    assert main([*TINY, "--lengths", "32", "--out", str(tmp_path), "--force"]) == 0  # TINY has --no-plots
    assert (tmp_path / "keep.txt").read_text() == "mine" and not (tmp_path / "time.png").exists()
    assert len(rows_of(tmp_path)) == 1


def test_default_output_is_a_new_dated_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--lengths", "32"]) == 0
    assert main([*TINY, "--lengths", "32"]) == 0
    runs = sorted((tmp_path / "bench-results").iterdir())
    assert len(runs) == 2 and all((run / "results.csv").is_file() for run in runs)


def test_resume_keeps_measured_points(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main([*TINY, "--lengths", "32", "--out", str(out)]) == 0
    first = rows_of(out)
    with (out / "results.csv").open("a") as f:
        f.write("20261130T000000Z-abcdef,cpu,flo")  # a line cut short by a killed run
    assert main([*TINY, "--lengths", "32", "64", "--out", str(out), "--resume"]) == 0
    rows = rows_of(out)
    assert [r["n"] for r in rows] == ["32", "64"]
    assert rows[0] == first[0] and rows[1]["session"] != first[0]["session"]
    assert len(json.loads((out / "machine.json").read_text())["sessions"]) == 2


def test_resume_fills_a_ratio_whose_baseline_was_capped_before(tmp_path: Path) -> None:
    args = [
        "bench",
        "--quick",
        "--threads",
        "1",
        "--methods",
        "mita",
        "--modes",
        "fwd",
        "--no-plots",
        "--lengths",
        "64",
    ]
    assert main([*args, "--max-n-per-method", "sdpa=32", "--out", str(tmp_path)]) == 0
    assert {r["method"]: r["speedup"] for r in rows_of(tmp_path)}["mita"] == ""
    assert main([*args, "--out", str(tmp_path), "--resume"]) == 0
    sdpa, mita = rows_of(tmp_path)
    assert sdpa["status"] == mita["status"] == "ok" and mita["session"] != sdpa["session"]
    assert float(mita["speedup"]) == pytest.approx(float(sdpa["median_s"]) / float(mita["median_s"]), 1e-4)
    assert mita["baseline_session"] == sdpa["session"]
    assert report.OTHER_SESSION in (tmp_path / "results.md").read_text()


def test_resume_refuses_another_machine(tmp_path: Path, capsys) -> None:
    assert main([*TINY, "--lengths", "32", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "machine.json").read_text())
    info["machine"]["cpu_model"] = "another CPU"
    (tmp_path / "machine.json").write_text(json.dumps(info))
    assert main([*TINY, "--lengths", "32", "--out", str(tmp_path), "--resume"]) == 2
    assert "differs" in capsys.readouterr().err


def test_unknown_method_gives_the_registry_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError) as registry:
        attention.get("nope")
    assert main(["bench", "--methods", "nope", "--out", str(tmp_path / "x")]) == 2
    assert str(registry.value) in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep", "topk"], "--sweep"),
        (["--sweep", "nonsense=1,2"], "none of the methods"),
        (["--max-n-per-method", "sdpa=lots"], "whole number"),
        (["--max-n-per-method", "nope=64"], "valid names"),
        (["--methods", "sdpa:topk=3"], "not an option of 'sdpa'"),
        (["--preset", "vision", "--lengths", "64"], "fixed lengths"),
        (["--quick", "--preset", "standard"], "--quick"),
        (["--batch", "0"], "--batch"),
        (["--device", "tpu"], "--device"),
        (["--min-repeats", "5", "--max-repeats", "2"], "--max-repeats"),
        (["--resume"], "--resume"),
        (["--rounds", "0"], "--rounds"),
    ],
    ids=[
        "sweep-no-values",
        "sweep-unknown-option",
        "cap-not-a-number",
        "cap-unknown-method",
        "option-not-taken",
        "vision-fixed-lengths",
        "quick-and-preset",
        "batch-zero",
        "device-unknown",
        "repeats-inverted",
        "resume-without-out",
        "rounds-zero",
    ],
)
def test_bad_arguments_are_named(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    out = ["--out", str(tmp_path / "x")] if "--resume" not in args else []
    assert main(["bench", *args, *out]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_resume_without_results_file(tmp_path: Path, capsys) -> None:
    assert main([*TINY, "--out", str(tmp_path), "--resume"]) == 2
    assert "results.csv" in capsys.readouterr().err


def test_cap_writes_not_measured_and_no_ratio(tmp_path: Path) -> None:
    args = [*QUICK, "--modes", "fwd", "--no-plots", "--max-n-per-method", "sdpa=128", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = {(r["series"], r["n"]): r for r in rows_of(tmp_path)}
    assert rows["sdpa", "256"]["status"].startswith("not measured") and rows["sdpa", "256"]["median_s"] == ""
    assert rows["mita", "256"]["speedup"] == ""
    assert float(rows["mita", "256"]["ideal_speedup"]) == pytest.approx(256 / 24, 1e-4)
    assert rows["mita", "128"]["speedup"] != ""
    assert "not measured" in (tmp_path / "results.md").read_text()


def test_every_registered_method_is_benchmarked_by_default() -> None:
    plan = bench.make_plan(build_parser().parse_args(["bench", "--quick"]))
    assert [s.label for s in plan.series] == list(dict.fromkeys(["sdpa", *attention.names()]))


def test_sweeps_expand_only_the_methods_that_take_the_option() -> None:
    series = bench.expand_series(["mita", "sdpa"], "sdpa", {"topk": [4, 8], "num_routed": [1, 2]})
    assert [s.label for s in series] == [
        "sdpa",
        "mita:num_routed=1,topk=4",
        "mita:num_routed=2,topk=4",
        "mita:num_routed=1,topk=8",
        "mita:num_routed=2,topk=8",
    ]
    options = series[1].options_at(bench.PRESETS["quick"], 128)  # user and sweep options over the preset's
    assert options == {"num_landmarks": 8, "topk": 4, "num_routed": 1}


def test_vision_preset_runs_with_its_grids(tmp_path: Path) -> None:
    args = ["bench", "--preset", "vision", "--threads", "1", "--methods", "mita", "--modes", "fwd", "--no-plots"]
    fast = ["--no-memory", "--budget", "0", "--warmup", "0", "--min-repeats", "1", "--out", str(tmp_path)]
    assert main([*args, *fast, "--profile"]) == 0
    profiles = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert profiles == ["mita-N1025-fwd.txt", "mita-N197-fwd.txt", "sdpa-N1025-fwd.txt", "sdpa-N197-fwd.txt"]
    assert "Self CPU" in (tmp_path / "profiles" / "sdpa-N197-fwd.txt").read_text()
    rows = {r["n"]: r for r in rows_of(tmp_path) if r["method"] == "mita"}
    assert rows["197"]["options"] == "grid=(14, 14),num_landmarks=25,num_prefix_tokens=1,num_routed=1,topk=25"
    assert rows["1025"]["options"] == "grid=(32, 32),num_landmarks=49,num_prefix_tokens=1,num_routed=1,topk=49"
    assert all(r["status"] == "ok" for r in rows.values())


def _row(series: str, n: int, speedup: float) -> report.Row:
    row = dict.fromkeys(report.FIELDS, "")
    row.update(series=series, n=str(n), mode="fwd", status="ok", speedup=str(speedup))
    return row


@pytest.mark.parametrize(
    ("speedups", "text"),
    [
        ((0.5, 1.2, 3.0), "as fast or faster from N = 2048 on (slower at 1024)"),
        ((0.5, 1.2, 0.9, 2.0), "as fast or faster from N = 8192 on (slower at 4096)"),
        ((1.0, 2.0), "as fast or faster at every measured N (1024 to 2048)"),
        ((2.0, 0.8), "slower at the largest measured N (2048)"),
    ],
    ids=["crosses", "crosses-twice", "always-faster", "never-after"],
)
def test_crossover(speedups: tuple[float, ...], text: str) -> None:
    rows = [_row("sdpa", 1024 * 2**i, 1.0) for i in range(len(speedups))]
    rows += [_row("mita", 1024 * 2**i, s) for i, s in enumerate(speedups)]
    assert report.crossovers(rows, "sdpa") == [f"- mita, forward: {text}"]


def _allocate_64_mib() -> torch.Tensor:
    return torch.ones(16 * MIB)  # 16 Mi float32 = 64 MiB


def _allocate_and_free_twice() -> None:
    for _ in range(2):
        x = torch.ones(16 * MIB)
        del x


@pytest.mark.parametrize(
    ("fn", "low", "high"),
    [(_allocate_64_mib, 64 * MIB, 65 * MIB), (_allocate_and_free_twice, 64 * MIB, 65 * MIB), (lambda: None, 0, MIB)],
    ids=["one-64MiB-tensor", "two-64MiB-in-turn", "nothing"],
)
def test_cpu_peak_memory_sees_known_allocations(fn, low: int, high: int) -> None:
    assert low <= timing.peak_memory(fn, device="cpu") < high


def test_forward_backward_peak_holds_inputs_output_and_gradients() -> None:
    case = timing.Case(1, 2, 256, 16)
    m = timing.measure(attention.build_op("sdpa"), case, "fwdbwd", budget_s=0, min_repeats=1)
    assert m.reference_bytes == 8 * case.tensor_bytes
    assert m.peak_bytes >= m.reference_bytes  # q, k, v, grad_out, out and three gradients are alive at once


def test_time_call_repeat_counts() -> None:
    calls = []
    assert timing.time_call(lambda: calls.append(1), budget_s=0, warmup=2, min_repeats=3)[1] == 3
    assert len(calls) == 5
    assert timing.time_call(lambda: None, budget_s=1e9, min_repeats=1, max_repeats=7)[1] == 7
    with pytest.raises(ValueError, match="min_repeats"):
        timing.time_call(lambda: None, min_repeats=0)


def test_a_call_slower_than_the_budget_is_timed_once() -> None:
    def slow(q, k, v):
        time.sleep(0.02)
        return q

    m = timing.measure(slow, timing.Case(1, 1, 8, 4), "fwd", budget_s=0.001, min_repeats=5, memory=False)
    assert m.repeats == 1 and m.peak_bytes is None


def test_rounds_time_the_methods_of_a_point_side_by_side(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple[str, int]] = []  # (method, N) of every attention call, in order
    build_op = attention.build_op

    def build(config):
        op = build_op(config)
        return lambda q, k, v: calls.append((config["name"], q.shape[2])) or op(q, k, v)

    monkeypatch.setattr(attention, "build_op", build)
    args = [*TINY, "--methods", "linear", "--rounds", "4", "--no-memory", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = rows_of(tmp_path)
    assert [(r["series"], r["n"], r["repeats"], r["status"]) for r in rows] == [
        ("sdpa", "128", "4", "ok"),
        ("linear", "128", "4", "ok"),
        ("sdpa", "256", "4", "ok"),
        ("linear", "256", "4", "ok"),
    ]
    assert float(rows[1]["speedup"]) == pytest.approx(float(rows[0]["median_s"]) / float(rows[1]["median_s"]), 1e-4)
    assert all(float(r["page_faults"]) >= 0 for r in rows) or timing.resource is None
    # per N: one warm-up call of each, then four rounds of one call of each in turn
    assert calls == [(m, n) for n in (128, 256) for m in ["sdpa", "linear"] * 5]


def test_side_by_side_keeps_measuring_past_a_failing_op() -> None:
    def broken(q, k, v):
        raise RuntimeError("out of memory")

    ops = {"sdpa": attention.get("sdpa").op, "broken": broken}
    results = timing.measure_side_by_side(ops, timing.Case(1, 2, 16, 8), "fwdbwd", 3, memory=True)
    assert isinstance(results["broken"], RuntimeError)
    assert results["sdpa"].repeats == 3 and results["sdpa"].peak_bytes >= timing.Case(1, 2, 16, 8).input_bytes("fwdbwd")
    with pytest.raises(ValueError, match="warmup >= 1"):
        timing.measure_side_by_side(ops, timing.Case(1, 2, 16, 8), "fwd", 3, warmup=0)


def test_bad_mode_and_columns_and_foreign_csv(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        timing.Case(1, 1, 8, 4).inputs("bwd")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        timing.peak_memory(lambda: None, device="meta")
    with pytest.raises(ValueError, match="unknown table columns"):
        report.markdown_table([], ["speed"])
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a results file"):
        report.read_rows(tmp_path / "results.csv")
    (tmp_path / "results.csv").write_text(",".join(report.FIELDS) + "\n" + "x," * (len(report.FIELDS) - 1) + "x\nx,x\n")
    assert len(report.read_rows(tmp_path / "results.csv")) == 1  # the line cut short is dropped


def test_demo_checks_agreement_and_prints_the_table(capsys) -> None:
    assert main(["demo", "--lengths", "256", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "max abs error" in out and "| 256 | mita |" in out and "| 256 | sdpa |" in out
    assert "MiTA on CPU runs on the fused C++ kernels" in out and "fused gradients" in out


def test_demo_rejects_bad_lengths(capsys) -> None:
    assert main(["demo", "--lengths", "0"]) == 2
    assert "--lengths" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "batch", "n", "m", "grid"), [("deit224", 16, 197, 25, (14, 14)), ("deit512", 4, 1025, 49, (32, 32))]
)
def test_deit_presets_hold_the_vision_targets_shapes(name: str, batch: int, n: int, m: int, grid: tuple) -> None:
    p = bench.PRESETS[name]
    assert (p.batch, p.heads, p.head_dim, p.lengths, p.fixed_lengths) == (batch, 6, 64, (n,), True)
    assert p.options_at(n) == {"num_landmarks": m, "topk": m, "grid": grid, "num_routed": 1, "num_prefix_tokens": 1}
    assert grid[0] * grid[1] + 1 == n  # one CLS token ahead of the patch grid
    args = build_parser().parse_args(["bench", "--preset", name])
    assert bench.make_plan(args).settings.rounds == 41  # side by side by default: their ratios are targets
    args = build_parser().parse_args(["bench", "--preset", name, "--rounds", "5"])
    assert bench.make_plan(args).settings.rounds == 5
    assert bench.make_plan(build_parser().parse_args(["bench"])).settings.rounds is None
