#!/usr/bin/env bash
# The packaging, proved: build the two wheels (mita, mita-experiments) from a copy of the
# checkout, check the build floor against the metadata, then install them NON-editable into a
# FRESH virtual environment (pinned by constraints.txt) one extra at a time and run the smallest
# form of every command from a temporary folder outside the checkout.
#   scripts/wheel-check.sh          (PYTHON=... picks the interpreter; KEEP=1 keeps the temp folder)
# Called by .ci/run after the test suite. About 6 minutes on 2 cores: builds 0.5, installs 2.5
# (torch 1), commands 3 (the fused kernel's compile 0.7).
set -euo pipefail
#
# THE PLAN (edit this block when commands change). One line each, run in order:
#   @ REQUIREMENT   install it into the fresh venv: mita or mita-experiments, with extras; the
#                   name is replaced by the wheel just built, so the venv never sees the checkout
#   anything else   a shell command run in the temp work folder; `mita` and `python` are the fresh
#                   venv's; $CHECK_* are the Python checks defined below; the arrays are shared sizes
# The installs are cumulative: each stage's commands run with only that stage's extras (and the
# ones before it) installed, so a command that needs an undeclared package fails here.
read -r -d '' PLAN <<'EOF' || true
# --- the library alone: imports, fused kernel compiled from the wheel's files, no experiment
@ mita
python -c "$CHECK_LIBRARY"
# --- the library's extras
@ mita[timm]
python -c "$CHECK_TIMM"
@ mita[hf]
python -c "$CHECK_HF"
# --- the command line, no extra
@ mita-experiments
mita --help
mita --version
mita taxonomy
mita demo --lengths 128 --threads 2
mita bench --quick --methods mita sdpa --lengths 128 --no-plots --out bench-op
mita recall generate --out recall-data "${RECALL[@]}"
mita recall train --out recall-run --data recall-data --device cpu --no-progress --no-tensorboard "${RECALL[@]}"
mita recall eval --checkpoint recall-run --attention mita:num_landmarks=2,topk=4 --device cpu
# --- Long Range Arena
@ mita-experiments[lra]
mita lra generate --task listops --out lra-data "${LRA_DATA[@]}"
mita lra train --task listops --data lra-data --device cpu --attention mita:num_landmarks=4,topk=4 --out lra-run --no-progress --no-tensorboard "${LRA[@]}"
mita lra eval --task listops --data lra-data --device cpu --checkpoint lra-run --option topk=8 --out lra-eval.json "${LRA[@]}"
mita bench lra --task listops --lengths 32 --steps 1 --warmup 0 --batch 2 --methods sdpa mita --out bench-lra
# --- vision
@ mita-experiments[vision]
mita vision flops --no-counted
mita vision swap --epochs 1 --batch-size 512 --attention mita --threads 2 --out vision-swap
mita bench vit --models deit_tiny_patch16_224 --sizes 32:1:4 --model-args depth=1 --rounds 1 --modes infer --out bench-vit
mita seg flops --no-counted
mita bench seg --sizes tiny --image 32 --depth 1 --landmarks 4 --topk 4 --rounds 1 --out bench-seg
# --- video
@ mita-experiments[video]
mita video flops --no-counted
mita bench video --frames 2 --layers 1 --rounds 1 --batch 1 --out bench-video
# --- everything: nothing new to install, the extras' references resolve
@ mita-experiments[all]
python -c "$CHECK_INSTALLED"
pip check
EOF

# Sizes the plan's commands share: the tiniest runs that still train, checkpoint and evaluate.
RECALL=(--set data.seq_len=12 --set data.num_pairs=2 --set data.vocab_size=8 --set data.num_train=64
    --set data.num_val=16 --set data.num_test=16 --set model.dim=16 --set model.mlp_dim=32 --set model.head_dim=8
    --set train.batch_size=16 --set train.steps=2 --set train.warmup=1 --set train.eval_every=2
    --set train.checkpoint_every=2 --set train.log_every=1)
LRA_DATA=(--set data.generate.num_train=32 --set data.generate.num_val=8 --set data.generate.num_test=8
    --set data.generate.min_length=8 --set data.generate.max_length=32 --set data.generate.seed=1)
LRA=(--variant small --set data.loader.max_length=32 --set train.steps=2 --set train.batch_size=8
    --set train.warmup=1 --set train.eval_every=2 --set model.dim=16 --set model.mlp_dim=16 --set model.head_dim=8)

# The library alone (no extra installed): it is the installed copy, every module imports but those
# that need an extra, the fused CPU kernel compiles from the wheel's files (into a fresh MITA_CACHE)
# and agrees with the reference, and nothing of mita_experiments is installed or imported.
read -r -d '' CHECK_LIBRARY <<'EOF' || true
import importlib, importlib.util, os, pkgutil, sys
import torch, mita
from mita.ops.mita import fused
where = os.path.realpath(mita.__file__)
assert not where.startswith(os.environ["CHECKOUT"] + os.sep), f"mita imported from the checkout: {where}"
for name in ("mita_experiments", "timm", "transformers"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed with mita alone"
assert fused.available(), f"the fused kernel did not build from the wheel: {fused.unavailable_reason()}"
assert str(fused.cache_root()) == os.environ["MITA_CACHE"], fused.cache_root()
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
out = mita.mita_attention(q, k, v, num_landmarks=4, topk=8, impl="fused")
torch.testing.assert_close(out, mita.mita_attention(q, k, v, num_landmarks=4, topk=8, impl="reference"))
out.sum().backward()
assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))
needs = {}
for info in pkgutil.walk_packages(mita.__path__, "mita."):
    try:
        importlib.import_module(info.name)
    except ImportError as err:
        needs[info.name] = (err.name or "?").split(".")[0]
bad = {m: n for m, n in needs.items() if n not in ("timm", "transformers", "triton")}
assert not bad, f"modules of mita that fail to import without an undeclared package: {bad}"
leaked = sorted(m for m in sys.modules if m.split(".")[0] == "mita_experiments")
assert not leaked, f"the library imported experiments: {leaked}"
print(f"mita {mita.__version__} at {where}; fused kernel OK; modules that need an extra: {needs}")
EOF

read -r -d '' CHECK_TIMM <<'EOF' || true
import timm, torch, mita
model = timm.create_model("mita_deit_tiny_patch16_224", depth=1, num_classes=3).eval()
vit = mita.convert(timm.create_model("deit_tiny_patch16_224", depth=1, num_classes=3), "mita", num_landmarks=4, topk=4)
with torch.no_grad():
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3) and vit.eval()(torch.randn(1, 3, 224, 224)).shape == (1, 3)
print("mita[timm]: mita_deit_tiny_patch16_224 and mita.convert run")
EOF

read -r -d '' CHECK_HF <<'EOF' || true
import torch, mita.integrations.hf
from transformers import AutoModel, ViTConfig
config = ViTConfig(image_size=32, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=64, mita_num_landmarks=16, mita_topk=8)
model = AutoModel.from_config(config, attn_implementation="mita").eval()
with torch.no_grad():
    assert model(torch.randn(1, 3, 32, 32)).last_hidden_state.shape == (1, 65, 32)
print("mita[hf]: a ViT with attn_implementation='mita' runs")
EOF

# Both installed, neither from the checkout; the console script is the venv's.
read -r -d '' CHECK_INSTALLED <<'EOF' || true
import importlib.metadata as md, json, os, mita, mita_experiments
for mod in (mita, mita_experiments):
    where = os.path.realpath(mod.__file__)
    assert not where.startswith(os.environ["CHECKOUT"] + os.sep), f"{mod.__name__} imported from the checkout: {where}"
for dist in ("mita", "mita-experiments"):
    direct = json.loads(md.distribution(dist).read_text("direct_url.json") or "{}")
    assert "archive_info" in direct and not direct.get("dir_info", {}).get("editable"), (dist, direct)
print("installed from the wheels, not editable:", {d: md.version(d) for d in ("mita", "mita-experiments")})
EOF

cd "$(dirname "$0")/.."
CHECKOUT=$(pwd -P)
PY="${PYTHON:-python3}"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/mita-wheel-check.XXXXXX")
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "wheel-check: kept $TMP"; else rm -rf "$TMP"; fi; }
trap cleanup EXIT
START=$SECONDS
step() { echo "wheel-check [$((SECONDS - START))s]: $*"; }

# 1. A copy of the checkout as git sees it (tracked and untracked files, not the ignored build/,
#    egg-info or caches, which setuptools would otherwise pack stale files from).
step "copying the checkout"
mkdir -p "$TMP/src" "$TMP/wheels" "$TMP/floor" "$TMP/work"
if git -C "$CHECKOUT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$CHECKOUT" ls-files -z --cached --others --exclude-standard \
        | "$PY" -c 'import os, sys; sys.stdout.write("".join(p + "\0" for p in sys.stdin.read().split("\0") if p and os.path.lexists(p)))' \
        | tar --null -T - -cf - | tar -xf - -C "$TMP/src"
else
    tar --exclude=.venv --exclude=.git --exclude=build --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -xf - -C "$TMP/src"
fi

# 2. The wheels, built as a user's pip builds them (isolated, newest setuptools).
step "building the wheels"
(cd "$TMP/src" && "$PY" -m pip wheel -q --no-deps -w "$TMP/wheels" . ./experiments 2> >(grep -v "is ignored: it is neither" >&2))
MITA_WHL=$(ls "$TMP"/wheels/mita-*.whl)
EXP_WHL=$(ls "$TMP"/wheels/mita_experiments-*.whl)

# 3. The wheels' contents and metadata: every file of each package in the source tree is in its
#    wheel (data files included), nothing else is (no tests, no checkout files), and the metadata
#    says what pyproject.toml says; the setuptools floor of [build-system] admits that metadata.
step "checking the wheels' contents, metadata and the build floor"
FLOOR=$("$PY" - "$TMP/src" "$MITA_WHL" "$EXP_WHL" <<'PY'
import email.parser, pathlib, re, sys, zipfile
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
src = pathlib.Path(sys.argv[1])
floors = set()
for root, wheel, package in ((src, sys.argv[2], "mita"), (src / "experiments", sys.argv[3], "mita_experiments")):
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    project = meta["project"]
    names = set(zipfile.ZipFile(wheel).namelist())
    source = {p.relative_to(root / "src").as_posix() for p in (root / "src" / package).rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    shipped = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert not source - shipped, f"{wheel}: files of {package} missing from the wheel: {sorted(source - shipped)}"
    assert not shipped - source, f"{wheel}: files in the wheel that are not in src/{package}: {sorted(shipped - source)}"
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    md = email.parser.Parser().parsestr(zipfile.ZipFile(wheel).read(info).decode())
    assert md["Name"] == project["name"] and md["Version"] == project["version"], (md["Name"], md["Version"])
    requires = [r.split(";")[0].replace(" ", "") for r in md.get_all("Requires-Dist") or []]
    for dep in project.get("dependencies", []):
        assert dep.replace(" ", "") in requires, f"{wheel}: Requires-Dist lacks {dep}"
    assert set(md.get_all("Provides-Extra") or []) == set(project.get("optional-dependencies", {})), wheel
    if isinstance(project.get("license"), str) or "license-files" in project:
        # PEP 639 (a license expression, license-files) is setuptools >= 77
        assert md["License-Expression"] == project["license"], (md["License-Expression"], project["license"])
        assert md.get_all("License-File"), f"{wheel}: no License-File"
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), f"{wheel}: LICENSE not packed"
        floor = next((m.group(1) for r in meta["build-system"]["requires"]
                      if (m := re.fullmatch(r"setuptools\s*>=\s*([0-9.]+)", r.strip()))), None)
        assert floor is not None, f"{root}/pyproject.toml: [build-system] must require setuptools>=77 (PEP 639)"
        assert tuple(int(x) for x in floor.split(".")) >= (77,), f"{root}: setuptools>={floor} < 77 (PEP 639)"
        floors.add(floor)
    print(f"  {pathlib.Path(wheel).name}: {len(shipped)} files, metadata OK", file=sys.stderr)
assert len(floors) <= 1, f"the two pyproject.toml files ask for different setuptools floors: {floors}"
print(floors.pop() if floors else "")
PY
)
if [ -n "$FLOOR" ]; then
    # the floor's release series (setuptools==77.*) builds the same wheels, without isolation
    step "building with the floor, setuptools==$FLOOR.*"
    "$PY" -m venv "$TMP/floor/venv"
    "$TMP/floor/venv/bin/pip" install -q "setuptools==$FLOOR.*" 2> >(grep -v "is ignored: it is neither" >&2)
    (cd "$TMP/src" && "$TMP/floor/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$TMP/floor" . ./experiments \
        2> >(grep -v "is ignored: it is neither" >&2))
    for whl in "$MITA_WHL" "$EXP_WHL"; do
        "$PY" - "$whl" "$TMP/floor/$(basename "$whl")" <<'PY'
import sys, zipfile
a, b = (zipfile.ZipFile(p) for p in sys.argv[1:])
strip = lambda z: sorted(n for n in z.namelist() if not n.endswith(("RECORD", "WHEEL")))
assert strip(a) == strip(b), f"setuptools' floor packs other files: {set(strip(a)) ^ set(strip(b))}"
meta = lambda z: [l for l in z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode().splitlines()
                  if l.startswith(("License", "Requires-Dist", "Provides-Extra", "Metadata-Version"))]
assert meta(a) == meta(b), f"setuptools' floor writes other metadata: {set(meta(a)) ^ set(meta(b))}"
PY
    done
fi

# 4. The fresh venv and the plan, from a folder outside the checkout with nothing of it on the path.
step "creating a fresh venv"
VENV="$TMP/venv"
"$PY" -m venv "$VENV"
export CHECKOUT CHECK_LIBRARY CHECK_TIMM CHECK_HF CHECK_INSTALLED
export MITA_CACHE="$TMP/mita-cache"  # the kernel is compiled from the wheel's sources, not reused
export PYTHONNOUSERSITE=1
unset PYTHONPATH
mita() { "$VENV/bin/mita" "$@"; }
python() { "$VENV/bin/python" "$@"; }
pip() { "$VENV/bin/pip" "$@"; }
install() {  # "mita-experiments[lra]" -> that wheel with the extra, plus mita's wheel for its pin
    local name=${1%%[*} extras="" wheel
    [[ $1 == *"["* ]] && extras="[${1#*[}"
    case $name in
        mita) wheel=$MITA_WHL ;;
        mita-experiments) wheel=$EXP_WHL ;;
        *) echo "wheel-check: the plan installs $name, which is no wheel of this checkout" >&2; return 1 ;;
    esac
    "$VENV/bin/pip" install -q -c "$CHECKOUT/constraints.txt" "$wheel$extras" "$MITA_WHL" \
        2> >(grep -v "is ignored: it is neither" >&2)
}
cd "$TMP/work"
COMMANDS=0
INSTALL_S=0
RUN_S=0
while IFS= read -r line; do
    [[ -z "${line// /}" || $line == \#* ]] && continue
    t0=$SECONDS
    if [[ $line == "@ "* ]]; then
        step "pip install ${line#@ }"
        install "${line#@ }"
        INSTALL_S=$((INSTALL_S + SECONDS - t0))
        continue
    fi
    step "+ $line"
    if ! (eval "$line") >"$TMP/out.log" 2>&1; then
        cat "$TMP/out.log"
        echo "wheel-check: FAILED (in $TMP/work, installed: $(ls "$VENV"/lib/python*/site-packages | grep -c dist-info) dists): $line" >&2
        exit 1
    fi
    tail -n 3 "$TMP/out.log" | cut -c1-160 | sed 's/^/    /'
    COMMANDS=$((COMMANDS + 1))
    RUN_S=$((RUN_S + SECONDS - t0))
done <<<"$PLAN"
step "OK: $COMMANDS commands in ${RUN_S}s, installs ${INSTALL_S}s, total $((SECONDS - START))s"
