"""The fused CPU kernel: dispatch, agreement with the grouped path past its block sizes, fallbacks.

(Agreement with the reference, gradcheck, determinism and isolation are in test_mita_op.)"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import mita.ops.mita as mita_ops
from mita import mita_attention
from mita.ops.mita import fused
from test_mita_op import Case

# Where a compiler is (CI included), the kernel must build: a failed build fails these tests.
pytestmark = pytest.mark.skipif(os.environ.get("MITA_FUSED") == "0", reason="MITA_FUSED=0 switches the kernel off")


@pytest.fixture
def spy(monkeypatch):
    """Records which implementation each call took."""
    calls: list[str] = []
    for name, fn in list(mita_ops.IMPLEMENTATIONS.items()):
        recorded = lambda *a, _n=name, _f=fn, **kw: calls.append(_n) or _f(*a, **kw)  # noqa: E731
        monkeypatch.setitem(mita_ops.IMPLEMENTATIONS, name, recorded)
    return calls


@pytest.fixture
def kernel() -> None:
    """The operators are registered (tests calling ``torch.ops.mita`` directly may run alone)."""
    assert fused.available(), fused.unavailable_reason()


@pytest.fixture
def fresh_state(monkeypatch):
    """Forget whether the kernel loaded, and restore that afterwards."""
    monkeypatch.setattr(fused, "_state", {})


def test_auto_takes_the_kernel_only_where_it_applies(spy) -> None:
    q, k, v, mask = Case(N=40, m=4, k=6, s=2, mask=True).inputs(dtype=torch.float32)
    opts = dict(num_landmarks=4, topk=6, num_routed=2, key_padding_mask=mask)
    with torch.no_grad():
        mita_attention(q, k, v, **opts)
        mita_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **opts)
        mita_attention(q, k, v, **opts, dropout_p=0.1)
        mita_attention(q, k, v, **opts, branches="shared")
    mita_attention(q.requires_grad_(), k, v, **opts)  # training too
    assert spy == ["fused", "fused", "grouped", "grouped", "fused"]


REFUSED = {"dropout": dict(dropout_p=0.1), "ablation": dict(branches="routed")}


@pytest.mark.parametrize("override", list(REFUSED.values()), ids=list(REFUSED))
def test_fused_refuses_what_it_cannot_do(override: dict) -> None:
    q, k, v, _ = Case(N=20, m=3, k=4).inputs()
    with pytest.raises(ValueError, match=f"impl='fused' cannot run this call: {next(iter(override))}="):
        mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused", **override)


LARGE = [
    Case(B=2, H=3, N=3000, D=32, m=24, k=40, s=1),  # large heads, batches: phase by phase
    Case(B=2, H=4, Hkv=2, N=1300, D=16, m=20, k=70, s=2, mask=True),
    Case(B=1, H=2, N=600, Nk=1500, D=16, m=10, k=600, s=3, mask=True),
]


@pytest.mark.parametrize("case", LARGE, ids=[str(c) for c in LARGE])
def test_fused_matches_grouped_across_blocks(case: Case) -> None:
    """Outputs and gradients at lengths past the kernel's key (512) and query (256) blocks, masks,
    GQA, cross-attention."""
    q, k, v, mask = case.inputs()
    grad = torch.randn_like(q)
    results = []
    for impl in ("fused", "grouped"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, r = mita_attention(*leaves, **case.kwargs(mask), impl=impl, return_routing=True)
        results.append((out, *torch.autograd.grad(out, leaves, grad), r))
    for a, b in zip(results[0][:4], results[1][:4]):
        assert (a - b).abs().max().item() <= 1e-10
    (r, rr) = results[0][4], results[1][4]
    if mask is None:  # (with padding, routing is compared in test_mita_op)
        assert torch.equal(r.experts, rr.experts) and torch.equal(r.routes, rr.routes)


FLOAT32 = [
    *LARGE,
    Case(B=2, H=3, N=700, D=24, m=9, k=40, s=2),
    Case(B=1, H=2, N=197, D=40, m=25, k=25, s=1),
    # one expert of 256 queries: scratch rows of 256 floats are padded (padded_ld), forward's and
    # backward's small-expert paths, and the gate's full query block
    Case(B=1, H=2, N=256, D=64, m=1, k=48, s=1),
    Case(B=1, H=2, N=256, D=16, m=1, k=32, s=1),
]


def _routed_keys(r) -> torch.Tensor:
    """(B, H, N, s, k): the keys of each query's routed experts."""
    B, H, N, s = r.routes.shape
    index = r.routes.reshape(B, H, N * s, 1).expand(-1, -1, -1, r.experts.shape[-1])
    return r.experts.gather(2, index).reshape(B, H, N, s, -1)


@pytest.mark.parametrize("case", FLOAT32, ids=[str(c) for c in FLOAT32])
def test_fused_float32_products_match_float64(case: Case) -> None:
    """float32 takes other products than float64 (brgemm, operands transposed by register blocks,
    any D): outputs and gradients against float64 on the same (float32) inputs, to float32's
    rounding, where the two pick the same experts and routes (a near-tie may go either way)."""
    q, k, v, mask = (t if t is None or t.dtype == torch.bool else t.float().double() for t in case.inputs())
    grad = torch.randn_like(q).float().double()
    results = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, r = mita_attention(*leaves, **case.kwargs(mask), impl="fused", return_routing=True)
        results.append((out, *torch.autograd.grad(out, leaves, grad.to(dtype)), r))
    (r32, r64) = results[0][4], results[1][4]
    # The keys each query attends: landmarks pooled from the same real tokens (padding) are equal,
    # and their exact tie may go to either copy in either dtype, with the same keys and output.
    keys32, keys64 = (_routed_keys(r) for r in (r32, r64))
    same = torch.equal(r32.experts, r64.experts) and torch.equal(keys32, keys64)
    assert same, "a near-tie went the other way in float32 on this draw: pick another case"
    for a, b in zip(results[0][:4], results[1][:4]):
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 2e-5 * max(scale, 1.0)


def test_fused_float32_is_deterministic_and_reads_no_uninitialised_memory() -> None:
    case = Case(B=2, H=2, N=700, D=32, m=16, k=24, s=2, mask=True)
    q, k, v, mask = case.inputs(dtype=torch.float32)
    old = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    leaves = [t.requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)
    try:  # the backward writes dk and dv without zero-filling them first: every row must be written
        runs = []
        for _ in range(2):
            out = mita_attention(q, k, v, **case.kwargs(mask), impl="fused")
            runs.append((out, *torch.autograd.grad(out, leaves, grad)))
    finally:
        torch.use_deterministic_algorithms(old[0])
        torch.utils.deterministic.fill_uninitialized_memory = old[1]
    for a, b in zip(*runs):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("case", [Case(B=2, H=3, N=100, D=32, m=8, k=12), Case(B=1, H=2, N=3000, D=32, m=16, k=24)])
def test_fused_results_do_not_depend_on_the_threads(case: Case) -> None:
    """Heads (small heads, N = 100) or each phase's items (large heads, N = 3,000) go to the threads in
    guided runs, so which thread computes what changes from call to call; every item has one writer,
    so one thread and two give bit-identical outputs and gradients."""
    q, k, v, _ = case.inputs(dtype=torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)
    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = mita_attention(q, k, v, **case.kwargs(None), impl="fused")
            runs.append((out, *torch.autograd.grad(out, leaves, grad)))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["bhnd", "qkv"])
def test_fused_results_do_not_depend_on_the_read_ahead(layout: str) -> None:
    """Reading the next small head's rows ahead (forward and backward; rows apart by less than a page,
    or views of one qkv buffer) only moves data into cache: outputs and gradients are bit-identical
    with it on and off, and the setting is restored."""
    assert fused.available()
    B, H, N, D = 2, 6, 197, 32
    qkv = torch.randn(B, N, 3, H, D)
    if layout == "qkv":
        leaf = qkv.requires_grad_()
        q, k, v = leaf.permute(2, 0, 3, 1, 4).unbind(0)
        leaves = [leaf]
    else:
        leaves = [t.permute(0, 2, 1, 3).contiguous().requires_grad_() for t in qkv.unbind(2)]
        q, k, v = leaves
    grad = torch.randn(B, H, N, D)
    before, runs = torch.ops.mita.read_ahead(), []
    try:
        for on in (True, False):
            assert torch.ops.mita.read_ahead(on) is on
            out = mita_attention(q, k, v, num_landmarks=9, topk=12, impl="fused")
            runs.append((out, *torch.autograd.grad(out, leaves, grad)))
    finally:
        torch.ops.mita.read_ahead(before)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_read_ahead_is_decided_per_process(monkeypatch) -> None:
    """MITA_READ_AHEAD=0 / 1 turns the read-ahead off / on; unset, it is on where the measured forward
    is faster with it; a bad value names the variable. The measurement leaves the setting as it was."""
    assert fused.available()
    speedup = {"x": 1.05}  # AMD Zen 4
    monkeypatch.setattr(fused, "read_ahead_speedup", lambda: speedup["x"])
    monkeypatch.delenv("MITA_READ_AHEAD", raising=False)
    assert fused.read_ahead()
    speedup["x"] = 0.97  # an Intel Xeon without AMX
    assert not fused.read_ahead()
    monkeypatch.setenv("MITA_READ_AHEAD", "1")
    assert fused.read_ahead()
    monkeypatch.setenv("MITA_READ_AHEAD", "0")
    speedup["x"] = 1.05
    assert not fused.read_ahead()
    monkeypatch.setenv("MITA_READ_AHEAD", "on")
    with pytest.raises(ValueError, match="MITA_READ_AHEAD='on'"):
        fused.read_ahead()
    monkeypatch.undo()
    before = torch.ops.mita.read_ahead()
    assert fused.read_ahead_speedup.__wrapped__(rounds=1) > 0 and torch.ops.mita.read_ahead() is before
    with FakeTensorMode():  # a first call under tracing still times real kernels
        assert fused.read_ahead_speedup.__wrapped__(rounds=1) > 0


def _kept_call(q: torch.Tensor | None = None) -> torch.Tensor:
    """A fused forward whose output (1 MiB for q of (1, 2, 2048, 64), drawn when not given) is over the
    kept memory's 256 KiB threshold."""
    q = torch.randn(1, 2, 2048, 64) if q is None else q
    return mita_attention(q, q, q, num_landmarks=8, topk=8, impl="fused")


def test_freed_outputs_serve_the_next_call(kernel) -> None:
    """A freed output's block is the next output of its size (pages already mapped), within the limit;
    ``empty_cache`` gives every kept block back."""
    held, limit = torch.ops.mita.kept_memory()
    try:
        out = _kept_call()
        block, size = out.data_ptr(), out.untyped_storage().nbytes()
        del out
        assert torch.ops.mita.kept_memory()[0] >= held + size
        again = _kept_call()
        assert again.data_ptr() == block
        torch.ops.mita.kept_memory(size)  # room for one such block: the second one freed is not kept
        other = _kept_call()
        del again, other
        assert 0 < torch.ops.mita.kept_memory()[0] <= size
        assert fused.empty_cache() > 0 and torch.ops.mita.kept_memory()[0] == 0
    finally:
        torch.ops.mita.kept_memory(limit)
    with pytest.raises(RuntimeError, match="limit must be >= 0"):
        torch.ops.mita.kept_memory(-1)


def test_scratch_buffers_are_kept_too(kernel) -> None:
    """A call's scratch of 256 KiB or more (here a small bfloat16 head's float32 output rows, 1,024 x 64)
    goes back to the kept memory, not to the OS, and the next call takes it again."""
    limit = torch.ops.mita.kept_memory()[1]
    try:
        fused.empty_cache()
        q = torch.randn(1, 1, 1024, 64).bfloat16()  # its bfloat16 output, 128 KiB, is under the threshold
        out = mita_attention(q, q, q, num_landmarks=8, topk=8, impl="fused")
        kept = torch.ops.mita.kept_memory()[0]
        assert kept >= 1024 * 64 * 4
        again = mita_attention(q, q, q, num_landmarks=8, topk=8, impl="fused")
        assert torch.ops.mita.kept_memory()[0] == kept and torch.equal(out, again)
    finally:
        torch.ops.mita.kept_memory(limit)


def test_profiler_counts_kept_outputs(kernel) -> None:
    """The profiler's memory events (`mita bench`'s peak) see an output from kept memory as allocated."""
    q = torch.randn(1, 2, 2048, 64)  # (drawn outside the profile: q alone is as large as the output)
    _kept_call(q)  # a first call, freed at once: its block is kept, the next call reuses it
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = _kept_call(q)
    events = prof.profiler.kineto_results.events()
    allocated = sum(e.nbytes() for e in events if e.name() == "[memory]" and e.nbytes() > 0)
    assert allocated >= out.untyped_storage().nbytes()


# _kept_call in a fresh process, its output held in a global until the interpreter exits.
KEPT_CHILD = "import torch; from mita import mita_attention; q = torch.randn(1, 2, 2048, 64); "
KEPT_CHILD += "OUT = mita_attention(q, q, q, num_landmarks=8, topk=8, impl='fused')"


def test_kept_outputs_outlive_the_interpreter(kernel) -> None:
    """An output still referenced at exit is freed during interpreter shutdown without a crash."""
    run = subprocess.run([sys.executable, "-c", KEPT_CHILD], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("value", ["lots", "-1"])
def test_bad_kept_limit_is_refused(kernel, value) -> None:
    """MITA_CPU_CACHE_MB is read at a process's first output; a bad value is an error that names it."""
    env = {**os.environ, "MITA_CPU_CACHE_MB": value}
    run = subprocess.run([sys.executable, "-c", KEPT_CHILD], capture_output=True, text=True, env=env)
    assert run.returncode != 0 and f"MITA_CPU_CACHE_MB='{value}': use a whole number of MiB" in run.stderr


def test_switched_off_falls_back_to_grouped(fresh_state, monkeypatch, spy) -> None:
    monkeypatch.setenv("MITA_FUSED", "0")
    q, k, v, _ = Case(N=20, m=3, k=4).inputs()
    with torch.no_grad():
        mita_attention(q, k, v, num_landmarks=3, topk=4)
        with pytest.raises(RuntimeError, match="not available: MITA_FUSED=0 switches it off"):
            mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused")
    assert spy == ["grouped", "fused"]


def test_failed_build_warns_once_and_falls_back(fresh_state, monkeypatch, tmp_path) -> None:
    bad = tmp_path / "fused_cpu.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(fused, "SOURCE", bad)
    monkeypatch.setenv("MITA_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="could not be built") as caught:
        assert not fused.available()
    assert not fused.available()  # decided once per process
    assert "expected unqualified-id" in str(caught[0].message)  # the compiler's own words, not cut
    q, k, v, _ = Case(N=20, m=3, k=4).inputs()
    with pytest.raises(RuntimeError, match=r"(?s)not available: it could not be built .*expected unqualified-id"):
        mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused")


def test_cache_dir_is_keyed_by_torch_capability_and_source(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MITA_CACHE", str(tmp_path))
    d = fused.cache_dir()
    assert d.parent == tmp_path and torch.__version__ in d.name and fused._isa() in d.name


def test_cache_dir_expands_home_and_ignores_the_checkout(monkeypatch, tmp_path) -> None:
    """``~`` in MITA_CACHE is the home folder; two checkouts of one source share one build."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MITA_CACHE", "~/kernels")
    assert fused.cache_root() == tmp_path / "kernels"
    first = fused.cache_dir()
    (tmp_path / "checkout-b").mkdir()
    for file in fused.sources():
        (tmp_path / "checkout-b" / file.name).write_bytes(file.read_bytes())
    monkeypatch.setattr(fused, "SOURCE", tmp_path / "checkout-b" / fused.SOURCE.name)
    assert fused.cache_dir() == first
    (tmp_path / "checkout-b" / "vec.h").write_text("// changed\n")  # a header is part of the key
    assert fused.cache_dir() != first


def test_build_files_hold_no_checkout_path(kernel) -> None:
    """The kernel is compiled from a copy in the cache: another checkout does not rebuild it."""
    ninja = (fused.cache_dir() / "build.ninja").read_text()
    assert str(fused.SOURCE.parent) not in ninja and str(fused.cache_dir() / fused.SOURCE.name) in ninja


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2", "AVX512"])
def test_sources_compile_with_clang(isa, tmp_path) -> None:
    """The kernel compiles with clang (zig's bundled clang, -O0), as macOS and CC=clang builds
    need: clang checks calls in templates that GCC leaves unchecked, and a bfloat16 call for
    doubles in a discarded branch once failed every clang build."""
    pytest.importorskip("ziglang")
    from torch.utils.cpp_extension import include_paths

    defines = [] if isa == "DEFAULT" else [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    if isa == "AVX512":  # with the bfloat16 products compiled in
        defines += ["-DMITA_BF16_PRODUCTS", "-mavx512bf16"]
    includes = [f"-I{p}" for p in include_paths()]
    cmd = [sys.executable, "-m", "ziglang", "c++", "-std=c++20", "-O0", "-c", "-o", str(tmp_path / "kernel.o")]
    done = subprocess.run(
        [*cmd, *fused._ISA_FLAGS.get(isa, []), *defines, *includes, str(fused.SOURCE)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and (tmp_path / "kernel.o").stat().st_size > 0, done.stderr[-4000:]


@pytest.mark.parametrize("fault", ["world-writable", "foreign"])
def test_untrusted_cache_is_refused(fault, fresh_state, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MITA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    if fault == "world-writable":
        (tmp_path / "cache").chmod(0o777)
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.warns(RuntimeWarning, match="not safe to load code from: .*(writable by every user|another user)"):
        assert not fused.available()
    q, k, v, _ = Case(N=20, m=3, k=4).inputs()
    with pytest.raises(RuntimeError, match="not available: the kernel cache is not safe"):
        mita_attention(q, k, v, num_landmarks=3, topk=4, impl="fused")


CHILD = """
import sys, torch, warnings
from pathlib import Path
from mita.ops.mita import fused
fused.SOURCE = Path(sys.argv[1])
torch.library.register_fake = lambda name: lambda fn: fn  # the stand-in source defines no operators
warnings.simplefilter("error")
print("loaded" if fused._load() is None else "failed")
"""


def _probe_loader(tmp_path: Path) -> Callable[[], subprocess.CompletedProcess]:
    """A fresh process that loads a stand-in kernel source (for speed) through a cache in tmp_path."""
    source = tmp_path / "probe.cpp"
    source.write_text("int mita_probe() { return 1; }\n")
    env = {**os.environ, "MITA_CACHE": str(tmp_path / "cache"), "MITA_FUSED": "1"}

    def load() -> subprocess.CompletedProcess:
        run = subprocess.run([sys.executable, "-c", CHILD, str(source)], env=env, capture_output=True, text=True)
        assert run.returncode == 0 and run.stdout.strip() == "loaded", run.stderr
        return run

    return load


def test_empty_or_corrupt_kernel_is_rebuilt(tmp_path) -> None:
    """A zero-byte, garbage or truncated .so in the cache is rebuilt, with a message."""
    load = _probe_loader(tmp_path)
    assert "compiling the fused CPU kernel" in load().stderr
    (so,) = Path(tmp_path / "cache").glob("*/*.so")
    assert "compiling" not in load().stderr  # cached
    whole = so.read_bytes()
    for damage in (b"", b"not an ELF file", whole[: len(whole) // 2]):  # empty, garbage, truncated
        so.write_bytes(damage)
        assert "compiling the fused CPU kernel" in load().stderr
        assert so.stat().st_size > 1000


def test_other_libraries_in_the_cache_are_never_loaded(tmp_path) -> None:
    """Only the folder's own build is opened: another library there (as torch's renamed second build,
    ``name_v1.so``, which registers the operators again) is not loaded, even to check it; a check that
    loaded it aborted the process ("Only a single TORCH_LIBRARY can be used")."""
    load = _probe_loader(tmp_path)
    load()
    (so,) = Path(tmp_path / "cache").glob("*/*.so")
    trap = tmp_path / "trap.cpp"
    trap.write_text("#include <cstdlib>\n__attribute__((constructor)) static void trap() { std::abort(); }\n")
    subprocess.run(["c++", "-shared", "-fPIC", str(trap), "-o", str(so.with_name(so.stem + "_v1.so"))], check=True)
    load()  # (asserts the process lived and loaded its own build)


def test_double_backward_matches_reference() -> None:
    """A graph of the gradient (create_graph) is taken through a differentiable path: exact, not dropped."""
    q, k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64) for _ in range(3))
    grads = []
    for impl in ("reference", "fused"):
        x = q.clone().requires_grad_()
        out = mita_attention(x, k, v, num_landmarks=4, topk=4, impl=impl)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.pow(2).sum() + g.pow(2).sum()).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask", [True, False], ids=["pooled-outside", "pooled-in-kernel"])
def test_gradgradcheck(mask: bool) -> None:
    case = Case(B=1, H=2, Hkv=1, N=12, D=4, m=3, k=4, s=2, mask=mask)
    q, k, v, key_mask = case.inputs()
    fn = lambda q, k, v: mita_attention(q, k, v, **case.kwargs(key_mask), impl="fused")  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, [t.requires_grad_() for t in (q, k, v)])


POOLED = [
    Case(B=2, H=3, N=50, D=8, m=(2, 3), k=9, s=2, grid=(7, 7), prefix=1),
    Case(B=1, H=2, Hkv=1, N=41, D=8, m=6, k=5, prefix=2),
    Case(B=2, H=2, N=20, Nk=33, D=8, m=4, k=6),
    Case(B=1, H=2, N=50, D=64, m=(3, 3), k=6, grid=(7, 7), prefix=1),  # whole 64-column chunks
    Case(B=1, H=2, N=37, D=72, m=(2, 2), k=5, grid=(6, 6), prefix=1),  # and a tail past them
]


@pytest.mark.parametrize("case", POOLED, ids=[str(c) for c in POOLED])
def test_landmarks_pooled_in_the_kernel_carry_their_gradient(case: Case) -> None:
    """Unmasked calls pool in the kernel (and unpool in its backward): the landmarks returned in the
    routing are the reference's, and a loss on them reaches q exactly as through the reference."""
    q, k, v, _ = case.inputs()
    results = []
    for impl in ("fused", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, r = mita_attention(*leaves, **case.kwargs(None), impl=impl, return_routing=True)
        loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum() + r.landmarks.pow(2).sum()
        results.append((out, r.landmarks, *torch.autograd.grad(loss, leaves)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("D", [64, 72, 136])
def test_float32_landmarks_pooled_in_the_kernel(D: int) -> None:
    """float32 pooling in the kernel (64 columns summed in registers, then the tail) against pool()."""
    case = Case(B=2, H=3, N=1 + 36, D=D, m=(2, 3), k=5, grid=(6, 6), prefix=1)
    q, k, v, _ = case.inputs(dtype=torch.float32)
    got = mita_attention(q, k, v, **case.kwargs(None), impl="fused", return_routing=True)[1].landmarks
    want = mita_attention(q, k, v, **case.kwargs(None), impl="reference", return_routing=True)[1].landmarks
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_both_schedules_agree_with_the_reference() -> None:
    """Small heads run head by head; with fewer heads than threads (or large heads) phase by phase."""
    case = Case(B=1, H=1, N=197, D=16, m=(5, 5), k=25, s=2, grid=(14, 14), prefix=1)
    q, k, v, _ = case.inputs()
    expected = mita_attention(q, k, v, **case.kwargs(None), impl="reference")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # one head: head by head on one thread, phase by phase on two
            torch.set_num_threads(n)
            got = mita_attention(q, k, v, **case.kwargs(None), impl="fused")
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_k_ties_and_signed_zeros_keep_the_lower_index(dtype) -> None:
    """Equal scores (+0 and -0 included) go to the lower key index (a stable sort's order; torch.topk
    leaves ties unordered); past the key block (512) the candidate buffer is cut many times
    (scores rising along the keys). float32 keeps k <= 256 in order by counting, above by a sort."""
    B, H, N, D = 1, 1, 1200, 2
    k = torch.zeros(B, H, N, D, dtype=dtype)
    k[..., 0] = torch.arange(N, dtype=dtype).remainder(7)  # many ties
    k[..., 1] = torch.arange(N, dtype=dtype) / N  # rising: each block replaces the best
    landmarks = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [-0.0, 0.0]]]], dtype=dtype)
    q, v = torch.randn(B, H, N, D, dtype=dtype), torch.randn(B, H, N, D, dtype=dtype)
    for topk in (1, 30, 256, 257, 600):
        _, r = mita_attention(
            q, k, v, num_landmarks=3, topk=topk, landmarks=landmarks, impl="fused", return_routing=True
        )
        scores = landmarks @ k.transpose(-1, -2)
        stable = scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]
        assert torch.equal(r.experts, stable), topk
        assert torch.equal(r.experts[0, 0, 2], torch.arange(topk))  # all +0 / -0: the first keys


@pytest.mark.parametrize("levels", [None, 3, 40])
def test_top_k_matches_a_stable_sort_on_random_scores(levels) -> None:
    """The selection (bisection on the keys' bits, then ranking by counts) against a stable sort, on
    keys of continuous values and of few distinct values (equal rows: exact ties at the k-th place),
    short rows (one cut at the end) and long ones (cut as the buffer fills), negative scores too."""
    gen = torch.Generator().manual_seed(7)
    for N, topk in ((197, 25), (197, 1), (197, 196), (1025, 49), (1500, 300), (40, 17)):
        k = torch.randn(1, 1, N, 4, generator=gen)
        if levels is not None:
            k = k.mul(levels / 4).round()
        landmarks = torch.randn(1, 1, 5, 4, generator=gen)
        q, v = torch.randn(1, 1, N, 4, generator=gen), torch.randn(1, 1, N, 4, generator=gen)
        _, r = mita_attention(
            q, k, v, num_landmarks=5, topk=topk, landmarks=landmarks, impl="fused", return_routing=True
        )
        scores = (landmarks @ k.transpose(-1, -2)).add(0.0)  # -0 as +0, as the kernel orders them
        stable = scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]
        assert torch.equal(r.experts, stable), (N, topk)


@pytest.mark.parametrize("dim", ["B", "H", "Hkv", "Nq", "Nk", "D", "m"])
def test_operator_refuses_empty_sizes(dim, kernel) -> None:
    """Every size is checked in C++: an error, never a crash (SIGFPE)."""
    sizes = dict(B=1, H=2, Hkv=2, Nq=8, Nk=8, D=4, m=2)
    sizes[dim] = 0
    B, H, Hkv, Nq, Nk, D, m = sizes.values()
    q, k, landmarks = torch.randn(B, H, Nq, D), torch.randn(B, Hkv, Nk, D), torch.randn(B, H, m, D)
    with pytest.raises(RuntimeError, match=r"must be >= 1|must be \(B, Hkv, Nk, D\)"):
        torch.ops.mita.fused_forward(q, k, k, landmarks, None, None, 1, 1, 0.5, 0.5)
    with pytest.raises(RuntimeError, match=r"must be >= 1|must be \(B, Hkv, Nk, D\)"):
        torch.ops.mita.fused_backward(q, q, k, k, landmarks, None, None, *(torch.empty(0),) * 6, 0.5, 0.5)


def test_operator_refuses_rows_of_stride_zero(kernel) -> None:
    """Rows of stride 0 (a tensor expanded along the tokens) would reach the products with a leading
    dimension of 0: the operators name the layout and the fix; mita_attention copies such inputs."""
    q, landmarks = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 2, 4)
    k = torch.randn(1, 2, 1, 4).expand(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match=r"stride\(-2\) >= size\(-1\)\); pass t.contiguous\(\)"):
        torch.ops.mita.fused_forward(q, k, q, landmarks, None, None, 2, 1, 0.5, 0.5)


def test_operator_schema_and_fake_kernel(kernel) -> None:
    """torch.library's checks: the schema matches what the kernel does, the fake kernel its shapes."""
    q, k, v, mask = Case(B=2, H=2, N=50, D=8, m=4, k=6, s=2, mask=True).inputs(dtype=torch.float32)
    landmarks = torch.randn(2, 2, 4, 8)
    k = k.masked_fill(~mask[:, None, :, None], 0)
    checks = ("test_schema", "test_faketensor")
    args = (q, k, v, landmarks, mask, mask, 6, 2, 0.3, 0.2)
    torch.library.opcheck(torch.ops.mita.fused_forward.default, args, test_utils=checks)
    out, experts, routes, _, *saved = torch.ops.mita.fused_forward(*args)
    args = (torch.randn_like(q), q, k, v, landmarks, mask, mask, experts, routes, out, *saved, 0.3, 0.2)
    torch.library.opcheck(torch.ops.mita.fused_backward.default, args, test_utils=checks)


def test_traces_under_torch_compile() -> None:
    q, k, v, _ = Case(N=40, m=4, k=6).inputs(dtype=torch.float32)
    fn = lambda q, k, v: mita_attention(q, k, v, num_landmarks=4, topk=6)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(fn, backend="eager")(q, k, v), fn(q, k, v))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(fn, backend="aot_eager")(*leaves).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_backward_operator_rejects_bad_saved_tensors(kernel) -> None:
    q, k, v, _ = Case(B=1, H=2, N=30, D=8, m=3, k=4).inputs(dtype=torch.float32)
    landmarks = torch.randn(1, 2, 3, 8)
    out, experts, routes, _, *saved = torch.ops.mita.fused_forward(q, k, v, landmarks, None, None, 4, 1, 0.3, 0.3)
    args = [torch.randn_like(q), q, k, v, landmarks, None, None, experts, routes, out, *saved, 0.3, 0.3]
    with pytest.raises(RuntimeError, match="routes out of range"):
        torch.ops.mita.fused_backward(*args[:8], routes + 3, *args[9:])
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.mita.fused_backward(*args[:9], out[:, :, :-1].contiguous(), *args[10:])


HALF = [
    (Case(N=63, D=60, m=8, k=9, s=3, H=3), {}),  # odd sizes, partial vectors everywhere
    (Case(N=197, D=64, m=25, k=25, H=8, Hkv=2, B=1), {}),  # GQA
    (Case(N=201, D=40, m=16, k=25, grid=(14, 14), prefix=1, mask=True), {"num_suffix_tokens": 4}),
    (Case(B=1, H=2, N=600, Nk=1500, D=16, m=10, k=600, s=3, mask=True), {}),  # cross-attention, long experts
    (Case(B=1, H=2, N=2100, D=48, m=24, k=40), {}),  # large heads: phase by phase, past the blocks
    # large heads with odd key blocks, m and k (bfloat16 products pad them), s = 2, a short sequence
    (Case(B=2, H=2, N=1999, D=64, m=25, k=33, s=2, mask=True), {}),
    (Case(B=1, H=2, N=2100, D=33, m=24, k=40), {}),  # odd D: bfloat16 products fall back to float32
    # large heads, s = 1, padded queries: their zero rows written by the gate, the rest by the merge
    (Case(B=2, H=1, N=1500, D=64, m=16, k=20, mask=True), {}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case,extra", HALF, ids=[str(c) for c, _ in HALF])
def test_half_precision_within_twice_the_reference_error(case: Case, extra: dict, dtype: torch.dtype) -> None:
    """bfloat16 and float16 q, k, v go into the kernels as they are (converted block by block into
    float32 scratch, or, for bfloat16 where ``fused.bf16_products()``, multiplied as bfloat16 with
    float32 accumulation, probabilities rounded to bfloat16; written back in the input dtype): output
    and gradients against float64 on the same (rounded) inputs, within twice the error of a
    half-precision attention on them, plus 1e-6 of the largest value. As flash-attn bounds its kernels
    by a PyTorch attention in the same dtype, whose probabilities are rounded to it: here the larger
    of MiTA's reference in the dtype (computed in float32, so only the output rounded) and SDPA in the
    dtype (relative to its largest value). Landmarks are given (pooled in float64), so that every run
    routes alike."""
    _check_half(case, extra, dtype)


def test_bf16_small_heads_with_rows_converted_once() -> None:
    """bfloat16 products on small heads whose experts hold three times the keys or more (m k >= 3 N):
    the key and value rows are converted once for the small routed experts (forward.h). Odd sizes, s = 2,
    a mask. (bfloat16 only, the path being its own; float16's backward, which takes delta from the
    rounded output, was 2.1-2.8x the reference's dq error at this size, 2-3 float16 ulps.)"""
    if not fused.bf16_products():
        pytest.skip("bfloat16 products are off on this CPU: the path under test is not taken")
    _check_half(Case(N=40, D=36, m=12, k=10, s=2, mask=True), {}, torch.bfloat16)


def _check_half(case: Case, extra: dict, dtype: torch.dtype) -> None:
    q, k, v, mask = (t if t is None or t.dtype == torch.bool else t.to(dtype).double() for t in case.inputs())
    grad = torch.randn_like(q).to(dtype).double()
    kwargs = {**case.kwargs(mask), **extra}
    _, routing = mita_attention(q, k, v, **kwargs, impl="reference", return_routing=True)
    landmarks = routing.landmarks.to(dtype).double()
    results = {}
    for impl, dt in (("reference", torch.float64), ("reference", dtype), ("fused", dtype)):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = mita_attention(*leaves, **kwargs, landmarks=landmarks.to(dt), impl=impl)
        results[impl, dt] = (out, *torch.autograd.grad(out, leaves, grad.to(dt)))
    for dt in (torch.float64, dtype):  # SDPA on the same rounded inputs: its relative errors below
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, enable_gqa=True)
        results["sdpa", dt] = (out, *torch.autograd.grad(out, leaves, grad.to(dt)))
    sdpa = [_max_rel(a, e) for a, e in zip(results["sdpa", dtype], results["sdpa", torch.float64])]
    exact, baseline, fused_ = results["reference", torch.float64], results["reference", dtype], results["fused", dtype]
    for name, a, b, e, rel in zip(("out", "dq", "dk", "dv"), fused_, baseline, exact, sdpa):
        assert a.dtype == dtype, name
        top = e.abs().max().item()
        bound = 2 * max((b.double() - e).abs().max().item(), rel * top) + 1e-6 * top
        assert (a.double() - e).abs().max().item() <= bound, name


def _max_rel(a: torch.Tensor, e: torch.Tensor) -> float:
    """The largest error of a against e, relative to e's largest value."""
    return ((a.double() - e).abs().max() / e.abs().max()).item()


def test_bf16_products_are_decided_by_the_cpu(monkeypatch) -> None:
    """bfloat16 products only in AVX-512 builds: on CPUs with AMX, or with AVX512-BF16 where torch's
    bfloat16 matmul is measured 1.25x its float32 or faster; MITA_BF16_PRODUCTS=0 / 1 forces them
    off / on; the choice is a define of the build, so part of the cache key; a bad value names the
    variable."""
    monkeypatch.delenv("MITA_BF16_PRODUCTS", raising=False)
    cpu = {"_is_avx512_bf16_supported": True, "_is_amx_tile_supported": False}
    for name in cpu:
        monkeypatch.setattr(torch.cpu, name, lambda name=name: cpu[name])
    monkeypatch.setattr(fused, "_isa", lambda: "AVX512")
    speedup = {"x": 2.0}  # Zen 4's vdpbf16ps
    monkeypatch.setattr(fused, "bf16_matmul_speedup", lambda: speedup["x"])
    assert fused.bf16_products() and "-DMITA_BF16_PRODUCTS" in fused._cflags()
    speedup["x"] = 0.55  # an Intel Xeon whose VM hides AMX
    assert not fused.bf16_products() and "-DMITA_BF16_PRODUCTS" not in fused._cflags()
    monkeypatch.setenv("MITA_BF16_PRODUCTS", "1")
    assert fused.bf16_products()
    monkeypatch.setenv("MITA_BF16_PRODUCTS", "0")
    speedup["x"] = 2.0
    assert not fused.bf16_products() and "-DMITA_BF16_PRODUCTS" not in fused._cflags()
    monkeypatch.setenv("MITA_BF16_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="MITA_BF16_PRODUCTS='yes'"):
        fused.bf16_products()
    monkeypatch.delenv("MITA_BF16_PRODUCTS")
    speedup["x"] = 0.55  # AMX is taken without measuring
    cpu.update(_is_avx512_bf16_supported=False, _is_amx_tile_supported=True)
    assert fused.bf16_products()
    monkeypatch.setenv("MITA_BF16_PRODUCTS", "1")
    assert fused.bf16_products()
    monkeypatch.setattr(fused, "_isa", lambda: "AVX2")
    assert not fused.bf16_products()
    monkeypatch.delenv("MITA_BF16_PRODUCTS")
    monkeypatch.setattr(fused, "_isa", lambda: "AVX512")
    cpu.update(_is_avx512_bf16_supported=False, _is_amx_tile_supported=False)
    speedup["x"] = 2.0
    assert not fused.bf16_products()


def test_bf16_matmul_speedup_is_a_positive_ratio() -> None:
    """The measured ratio is finite and positive, and cached for the process."""
    first = fused.bf16_matmul_speedup()
    assert 0 < first < float("inf") and fused.bf16_matmul_speedup() == first


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, from mkldnn.flags
def test_bf16_with_onednn_disabled_takes_the_float32_path() -> None:
    """brgemm refuses bfloat16 VNNI operands while oneDNN is disabled: a bfloat16 call (a large
    head: both passes) then runs the float32-scratch path instead of failing, to the same result
    within bfloat16's rounding."""
    q, k, v = (t.bfloat16() for t in Case(B=1, H=2, N=2100, D=64, m=24, k=40).inputs(torch.float32)[:3])
    landmarks = q[:, :, :2100:88][:, :, :24]  # given (bfloat16 already): both paths score them alike
    results = []
    for enabled in (True, False):
        with torch.backends.mkldnn.flags(enabled=enabled):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = mita_attention(*leaves, num_landmarks=24, topk=40, landmarks=landmarks, impl="fused")
            out.sum().backward()
            results.append([out.float(), *(t.grad.float() for t in leaves)])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_makes_no_float32_copies_of_the_inputs(dtype: torch.dtype) -> None:
    """No whole-tensor conversion around the kernels: forward and backward make no copy of q, k, v,
    the output or its gradient (a (B, H, N, D) tensor)."""
    q, k, v, _ = (t if t is None else t.to(dtype) for t in Case(N=300, D=32, m=8, k=16).inputs())
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with torch.profiler.profile(record_shapes=True) as prof:
        out = mita_attention(*leaves, num_landmarks=8, topk=16, impl="fused")
        out.backward(torch.ones_like(out))
    copies = [e for e in prof.events() if e.name in ("aten::_to_copy", "aten::copy_")]
    assert not [e for e in copies if list(q.shape) in e.input_shapes], [e.name for e in copies]
    assert all(t.grad.dtype == dtype for t in leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_large_heads_forward_peak_is_about_the_output(dtype: torch.dtype) -> None:
    """Large heads keep their float32 output rows a group of heads at a time: the forward allocates
    little beyond its output (half precision kept a float32 copy of the whole output, 3.2x its bytes)."""
    q, k, v = (torch.randn(1, 16, 4096, 64).to(dtype) for _ in range(3))
    call = functools.partial(mita_attention, q, k, v, num_landmarks=16, topk=16, impl="fused")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two threads take one head per group here
    try:
        with torch.no_grad():
            call()  # the first call's blocks are kept: the profiled call takes them again
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                out = call()
    finally:
        torch.set_num_threads(threads)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    peak = max(itertools.accumulate(e.nbytes() for e in events))
    assert peak < 1.4 * out.untyped_storage().nbytes(), peak / out.untyped_storage().nbytes()


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_strided_inputs_and_gradients_are_read_in_place(hkv: int) -> None:
    """q, k, v as a timm block makes them (views of one qkv buffer) and an upstream gradient in the
    (B, N, H, D) layout a projection sends back: the kernels read them without copies, agree with
    the reference, and write the output as (B, N, H, D), so the block's transpose is free."""
    B, N, H, D = 2, 50, 4, 8
    qkv = torch.randn(B, N, 3, H, D, dtype=torch.float64)
    views = [t[:, :hkv] if i else t for i, t in enumerate(qkv.permute(2, 0, 3, 1, 4).unbind(0))]
    grad = torch.randn(B, N, H, D, dtype=torch.float64).transpose(1, 2)
    results = []
    for impl, inputs in (("fused", views), ("reference", [t.contiguous() for t in views])):
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = mita_attention(*leaves, num_landmarks=6, topk=7, num_routed=2, impl=impl)
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert results[0][0].transpose(1, 2).is_contiguous()


def test_expanded_inputs() -> None:
    """q expanded along the heads (read in place), k and v along the tokens (rows of stride 0, copied:
    every key the same, so every score ties) and the gradient of a sum over the tokens (rows of stride
    0), in a call of many small heads per thread (each reads the next head's rows ahead): the kernels
    agree with the reference, ties to the lower key index in both."""
    B, H, N, D = 2, 6, 40, 8
    q0, k0, v0 = (torch.randn(B, *shape, D, dtype=torch.float64) for shape in ((1, N), (H, 1), (H, 1)))
    weight = torch.randn(B, H, D, dtype=torch.float64)
    results = []
    for impl in ("fused", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q0, k0, v0)]
        q, k, v = leaves[0].expand(B, H, N, D), leaves[1].expand(B, H, N, D), leaves[2].expand(B, H, N, D)
        out = mita_attention(q, k, v, num_landmarks=5, topk=6, impl=impl)
        results.append((out, *torch.autograd.grad(out.sum(dim=2), leaves, weight)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scales", [(4.0, 0.05), (0.05, 4.0), (1.0, 1.0)], ids=["routed-wins", "shared-wins", "even"])
def test_float32_merge_of_the_two_softmaxes_across_their_range(scales: tuple[float, float]) -> None:
    """The float32 kernel merges the routed and shared softmaxes with one exponential and a series
    for log(1 + e): against the float64 reference, outputs and gradients to float32 rounding. The
    shared-minus-routed log-sum-exp gaps of the three settings span -105 to -6, -2 to 23 and -23 to 0
    (one branch dominating either way; exp(-105) underflows in float32)."""
    case = Case(B=2, H=3, N=200, D=32, m=9, k=12)
    q, k, v, _ = case.inputs()
    scale, landmark_scale = scales
    opts = dict(num_landmarks=case.m, topk=case.k, scale=scale, landmark_scale=landmark_scale)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mita_attention(*ref_leaves, **opts, impl="reference")
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out = mita_attention(*leaves, **opts, impl="fused")
    grads = torch.autograd.grad(out, leaves, grad.float())
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 2e-5
