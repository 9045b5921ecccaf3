"""``mita bench --device cuda`` / ``--preset gpu`` without a GPU: arguments, refusals, CSV and markdown."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mita_experiments.benchmarks import gpu
from mita_experiments.benchmarks.timing import Measurement
from mita_experiments.cli import build_parser, main


def _args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], "CUDA is not available"),
        (["--preset", "gpu", "--device", "cuda:0"], "CUDA is not available"),
        (["--preset", "gpu"], "pass --device cuda"),
        (["--device", "cuda", "--methods", "sdpa"], "CUDA is not available"),
    ],
)
def test_refuses_without_cuda(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_which_runs_take_the_gpu_comparison() -> None:
    assert gpu.wants_gpu(_args("--device", "cuda"))
    assert gpu.wants_gpu(_args("--preset", "gpu", "--device", "cuda"))
    assert not gpu.wants_gpu(_args("--device", "cuda", "--methods", "mita"))  # the registry's methods on CUDA
    assert not gpu.wants_gpu(_args("--device", "cuda", "--preset", "standard"))
    assert not gpu.wants_gpu(_args())


@pytest.fixture
def fake_gpu(monkeypatch):
    """CUDA 'available', a fixed machine, three series, and a measure that fails for one of them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu, "machine_info", lambda device: {"cuda_device": "Fake GPU", "device": device})

    def op(q, k, v):
        return q

    def broken(q, k, v):
        raise RuntimeError("No available kernel")

    ops = {
        gpu.BASELINE: ("sdpa", "backend=FLASH_ATTENTION", op),
        "sdpa[CUDNN_ATTENTION]": ("sdpa", "backend=CUDNN_ATTENTION", broken),
        "mita[triton]": ("mita", "impl=triton", op),
    }
    monkeypatch.setattr(gpu, "series_ops", lambda opts: ops)

    def measure(fn, case, mode, **kw):
        fn(None, None, None)
        t = 1e-3 * case.n / 1024 * (2 if fn is op and mode == "fwdbwd" else 1)
        return Measurement(t, 3, 10 * case.tensor_bytes, case.reference_bytes(mode))

    monkeypatch.setattr(gpu, "measure", measure)


def test_plan_overrides_and_refusals(fake_gpu) -> None:
    plan = gpu.make_gpu_plan(_args("--device", "cuda", "--lengths", "2048", "--dtype", "float16", "--head-dim", "64"))
    assert plan.preset.lengths == (2048,) and plan.preset.dtypes == ("float16",) and plan.preset.head_dims == (64,)
    full = gpu.make_gpu_plan(_args("--preset", "gpu", "--device", "cuda")).preset
    assert full.lengths[0] == 1024 and full.lengths[-1] == 131072
    assert full.dtypes == ("bfloat16", "float16") and full.head_dims == (64, 128) and full.modes == ("fwd", "fwdbwd")
    for argv, message in [
        (["--resume", "--out", "x"], "--resume is not supported"),
        (["--lengths", "0"], "--lengths must be positive"),
        (["--dtype", "float64"], "bfloat16, float16 or float32"),
        (["--heads", "0"], "--heads must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            gpu.make_gpu_plan(_args("--device", "cuda", *argv))


def test_writes_csv_and_markdown_and_keeps_going_past_a_failed_backend(fake_gpu, tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu"
    argv = ["bench", "--device", "cuda", "--lengths", "1024", "4096", "--head-dim", "64", "--out", str(out)]
    assert main(argv) == 0  # a baseline backend that fails is reported, not a failure of the run
    with (out / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * 3  # dtypes x lengths x modes x series
    by = {(r["dtype"], r["n"], r["mode"], r["series"]): r for r in rows}
    broken = by["bfloat16", "1024", "fwd", "sdpa[CUDNN_ATTENTION]"]
    assert broken["status"].startswith("failed: RuntimeError: No available kernel") and broken["speedup"] == ""
    base, mita = by["float16", "4096", "fwdbwd", gpu.BASELINE], by["float16", "4096", "fwdbwd", "mita[triton]"]
    assert float(mita["speedup"]) == pytest.approx(float(base["median_s"]) / float(mita["median_s"]))
    assert float(base["model_flops"]) == pytest.approx(4 * 4096**2 * 64 * 8, rel=1e-5)  # B = 1, H = 8
    assert float(mita["ideal_speedup"]) == pytest.approx(4096 / (2 * 64 + 64), rel=1e-5)
    md = (out / "results.md").read_text()
    assert "Fake GPU" in md and "## bfloat16, D = 64" in md and "## float16, D = 64" in md
    assert "| mita[triton] | 4096 | fwdbwd |" in md
    assert "failed: RuntimeError" in md
    assert (out / "machine.json").is_file()


def test_a_failed_mita_point_fails_the_run(fake_gpu, monkeypatch, tmp_path: Path) -> None:
    ops = dict(gpu.series_ops({}))
    method, options, _ = ops["mita[triton]"]
    ops["mita[triton]"] = (method, options, ops["sdpa[CUDNN_ATTENTION]"][2])
    monkeypatch.setattr(gpu, "series_ops", lambda opts: ops)
    argv = ["bench", "--device", "cuda", "--lengths", "1024", "--dtype", "bfloat16", "--head-dim", "64"]
    assert main([*argv, "--modes", "fwd", "--out", str(tmp_path / "o")]) == 1


def test_series_cover_mita_paths_and_every_sdpa_backend() -> None:
    ops = gpu.series_ops(dict(gpu.GPU_PRESET.mita))
    assert next(iter(ops)) == gpu.BASELINE
    assert {"sdpa[EFFICIENT_ATTENTION]", "sdpa[CUDNN_ATTENTION]", "mita[triton]", "mita[grouped]"} <= set(ops)
    method, options, op = ops["mita[grouped]"]
    q = torch.randn(1, 2, 256, 16)
    assert method == "mita" and "impl=grouped" in options and op(q, q, q).shape == q.shape
