#!/usr/bin/env bash
# For whoever has an NVIDIA GPU: the CUDA tests, then the GPU benchmark preset (< 8 min on one H100).
#   scripts/gpu-check.sh [OUT_DIR]        (default OUT_DIR: gpu-results; PYTHON=... to pick the interpreter)
# The tests run the Triton kernels compiled for the GPU against the reference (tests/test_mita_triton.py),
# every CUDA path traced with fake tensors and on the device (tests/test_mita_cuda.py), and the
# CUDA cases of the operator tests. The benchmark writes OUT_DIR/results.csv, results.md, machine.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${1:-gpu-results}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device visible to torch')"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m pytest -q -p no:cacheprovider tests/test_mita_triton.py tests/test_mita_cuda.py
"$PY" -m pytest -q -p no:cacheprovider tests/test_mita_op.py tests/test_ops.py tests/test_mita_masks_grids.py -k cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$PY" -m mita_experiments bench --preset gpu --device cuda --out "$OUT" --force
echo "gpu-check: tests passed; benchmark table in $OUT/results.md"
