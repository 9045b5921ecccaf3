#!/usr/bin/env bash
# For whoever has an NVIDIA GPU: the CUDA tests, a kernel profile, then the GPU benchmark preset.
#   scripts/gpu-check.sh [OUT_DIR] [extra mita bench options]   (default OUT_DIR: gpu-results; PYTHON=... for the interpreter)
# The tests run the Triton kernels compiled for the GPU against the reference (tests/test_mita_triton.py),
# every CUDA path traced with fake tensors and on the device (tests/test_mita_cuda.py), and the CUDA
# cases of the other tests. scripts/gpu_profile.py lists the CUDA kernels of one call at N = 65,536 and
# 4,096 (wall time against GPU time); scripts/gpu_ab.py times split-K and torch.compile side by side.
# The benchmark writes OUT_DIR/results.csv, results.md, machine.json; each step's log is OUT_DIR/*.log.
# Extra options go to the benchmark, e.g. `--lengths 4096 16384 65536 --dtype bfloat16` for a short run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${1:-gpu-results}"
shift || true
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device visible to torch')" || exit 1
mkdir -p "$OUT"
export PYTHONPATH="src:experiments/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/machine.log"
"$PY" -m pytest -q -p no:cacheprovider tests/test_mita_triton.py tests/test_mita_cuda.py 2>&1 | tee "$OUT/tests.log" || status=1
"$PY" -m pytest -q -p no:cacheprovider -k cuda tests/test_mita_op.py tests/test_ops.py tests/test_layers.py \
  experiments/tests/test_bench_gpu.py 2>&1 | tee -a "$OUT/tests.log" || status=1
"$PY" scripts/gpu_profile.py 2>&1 | tee "$OUT/profile.log" || status=1
"$PY" scripts/gpu_profile.py --n 4096 --rows 40 2>&1 | tee "$OUT/profile4096.log" || status=1
"$PY" scripts/gpu_ab.py 2>&1 | tee "$OUT/ab.log" || status=1
"$PY" -m mita_experiments bench --preset gpu --device cuda --out "$OUT" --force "$@" 2>&1 | tee "$OUT/bench.log" || status=1
[ "$status" = 0 ] && echo "gpu-check: passed; benchmark table in $OUT/results.md" || echo "gpu-check: FAILED (see $OUT/*.log)"
exit "$status"
