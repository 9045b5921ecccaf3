#!/usr/bin/env bash
# The wheels as a user gets them: build both distributions, install them NON-editable in a fresh
# virtual environment (the library alone, then with every extra), and run the smallest form of
# every command from outside the checkout. Called by .ci/run after the test suite.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
step() { echo "+ $*" >&2; }

step "build the wheels"
"$PY" -m pip wheel -q --no-deps -w "$WORK/wheels" "$REPO" "$REPO/experiments"
LIB=$(ls "$WORK"/wheels/mita-*.whl)
EXP=$(ls "$WORK"/wheels/mita_experiments-*.whl)

step "the library alone, in a fresh environment"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q -c "$REPO/constraints.txt" "$LIB"
cd "$WORK"  # nothing is imported from the checkout from here on
MITA_CACHE="$WORK/cache" "$VPY" - <<'PY'
import importlib.util, torch, mita
assert "site-packages" in mita.__file__, mita.__file__
assert importlib.util.find_spec("mita_experiments") is None, "pip install mita must carry only the library"
from mita.ops.mita import fused
q = torch.randn(1, 2, 37, 16)
out = mita.mita_attention(q, q, q, num_landmarks=4, topk=5, impl="fused")  # the kernel builds from the wheel
ref = mita.mita_attention(q, q, q, num_landmarks=4, topk=5, impl="reference")
assert fused.available() and torch.allclose(out, ref, atol=1e-5)
print("library wheel ok")
PY

step "every extra"
"$VPY" -m pip install -q -c "$REPO/constraints.txt" "$LIB[timm,hf]" "$EXP[all]"
export MITA_CACHE="$WORK/cache" OMP_NUM_THREADS=2
M="$WORK/venv/bin/mita"
D="$WORK/runs"
# The smallest form of every command (one per line; edit here when a command changes).
run() { step "mita $*"; "$M" "$@" > "$WORK/last.log" 2>&1 || { cat "$WORK/last.log"; exit 1; }; }
LRA_SET=(--set data.generate.num_train=64 --set data.generate.num_val=16 --set data.generate.num_test=16)
TRAIN_SET=(--set train.steps=2 --set train.batch_size=8 --set train.eval_every=2 --set train.checkpoint_every=2)
RECALL_SET=(--set data.seq_len=12 --set data.num_pairs=2 --set data.vocab_size=8 --set data.num_train=64 --set data.num_val=16)
run --help
run taxonomy
run demo --lengths 256 --threads 2
run bench --methods mita sdpa --lengths 256 --modes fwd --rounds 1 --no-memory --out "$D/bench"
run bench lra --task listops --methods sdpa mita --lengths 64 --steps 1 --batch 2 --out "$D/bench-lra"
run lra generate --task listops "${LRA_SET[@]}" --out "$D/listops"
run lra train --task listops --data "$D/listops" "${TRAIN_SET[@]}" --out "$D/lra-run" --no-progress --no-tensorboard
run lra eval --task listops --data "$D/listops" --checkpoint "$D/lra-run/model.safetensors"
run recall generate "${RECALL_SET[@]}" --out "$D/recall-data"
run recall train --data "$D/recall-data" "${RECALL_SET[@]}" "${TRAIN_SET[@]}" --out "$D/recall-run" --no-progress --no-tensorboard
run recall eval --checkpoint "$D/recall-run"
run vision flops --no-counted --out "$D/vflops"
run vision swap --epochs 1 --attention mita --threads 2 --out "$D/vswap"
run video flops --no-counted --out "$D/video-flops"
echo "wheel check ok"
