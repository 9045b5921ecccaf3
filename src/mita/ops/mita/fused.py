"""Fused MiTA on CPU: C++ forward and backward kernels (``csrc/fused_cpu.cpp``).

The forward runs the grouped algorithm block by block in cache (no grouped buffers, no
Python-side bookkeeping) and calls the BLAS that PyTorch links for every matrix product;
it saves only the shared values and two log-sum-exps, from which the backward recomputes
the probabilities it needs, like flash attention.
It is compiled on first use with the compiler already on the machine and cached in
``$MITA_CACHE`` (default ``~/.cache/mita``), keyed by everything that makes a build
differ (never by the checkout), so a user waits once; a cache folder of another user or
writable by everyone is refused. ``MITA_FUSED=0`` turns it off; if it cannot be built or
loaded, MiTA falls back to the pure-PyTorch grouped path with one warning.

Half precision (issue 29): bfloat16 and float16 q, k, v (and the output's gradient) go into the
kernels as they are, without whole-tensor copies. The kernels convert each block they read into
float32 scratch (a key block, a query block, an expert's gathered rows; small experts convert as
they load), compute every product, softmax and merge in float32, and round the output (and dq,
dk, dv) into the input dtype; the landmarks, v~ and log-sum-exps stay float32. Where the CPU
multiplies bfloat16 faster than float32 (:func:`bf16_products`: AMX, or AVX512-BF16 measured
faster), bfloat16 calls instead multiply bfloat16 operands with float32 accumulation
(``at::native::cpublas::brgemm`` on VNNI-packed operands): in a large head every product of the
forward and the backward (probabilities and score gradients rounded to bfloat16, as PyTorch's CPU
flash attention rounds them; the gate's shared values split into two bfloat16 halves); a small head's
forward takes them where brgemm does its products (its small experts keep float32 register tiles),
its backward none; softmax, merges and sums stay float32. Verified by
``tests/test_mita_fused.py``: outputs and gradients within twice the error of the reference in the
same dtype against float64 (odd sizes, masks, prefix and suffix tokens, GQA, cross-attention,
both schedules), and no copy of a (B, H, N, D) tensor in the profile of a forward and backward.
Speed: docs/performance.md, "Half precision" (float32 scratch on AMD Zen 3 and on an Intel Xeon
without AMX; bfloat16 products on AMD Zen 4 and on AMX Xeons).
float16 products (brgemm needs AVX512-FP16 there) are not implemented.

Kept memory: the tensors the kernels return (the output, the saved values, dq, dk, dv) and their
scratch buffers, blocks of 256 KiB or more, come from an allocator of their own that keeps freed
blocks for the next call of the same shapes, so their pages are not faulted in again (glibc maps
large blocks anew on every call: 1-2 us a 4 KiB page, 8 ms of a 66 ms forward at N = 16,384;
docs/performance.md, "Fresh memory"). It holds at most ``MITA_CPU_CACHE_MB`` MiB (default 256; 0
keeps nothing; read at the first call) of freed blocks, which :func:`empty_cache` gives back, like
``torch.cuda.empty_cache``.
The profiler's memory events count a kept block as freed, as they count torch's CUDA cache.

Merged duplicate keys (``merge_duplicates=True``) pass their per-key logit offsets (B, Hkv, Nk) to
both kernels, which add them to the affinities and the routed logits and treat a key with an
infinite offset as padded in its kv head.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import statistics
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import torch

from ..pooling import pool, pool_bins
from ..tiling import zero_padding
from .config import MiTAConfig
from .grouped import mita_attention_grouped

SOURCE = Path(__file__).with_name("csrc") / "fused_cpu.cpp"  # one translation unit: it includes the headers beside it
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],  # F16C: float16 inputs converted by vcvtph2ps
}
_lock = threading.Lock()
_state: dict[str, object] = {}


def _isa() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return "AVX512" if cap.startswith("AVX512") else "AVX2" if cap == "AVX2" else "DEFAULT"


def bf16_products() -> bool:
    """Whether bfloat16 calls multiply bfloat16 operands (float32 accumulation) instead of float32.

    Decided once per process from what torch and the CPU report: an AVX-512 build on a CPU with AMX
    (oneDNN's brgemm on AMX's tiles: about 5x float32's rate on an Intel Xeon, 2026-12-05), or with
    AVX512-BF16 where torch's bfloat16 matmul is measured at least 1.25x its float32
    (:func:`bf16_matmul_speedup`). The instruction alone does not say it: torch's bfloat16 matmul
    runs at 2-3x its float32 on AMD Zen 4, at 0.5-0.7x on an Intel Xeon whose VM hides AMX, where the
    products made the bfloat16 kernels 1.05-1.49x slower than float32 (docs/performance.md, "Half
    precision"). Elsewhere brgemm would emulate them. ``MITA_BF16_PRODUCTS=0`` turns them off,
    ``=1`` on for any AVX-512 build. While oneDNN is disabled
    (``torch.backends.mkldnn.flags(enabled=False)``) the kernels take the float32 path per call:
    torch's brgemm then refuses bfloat16 operands.
    """
    choice = os.environ.get("MITA_BF16_PRODUCTS", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"MITA_BF16_PRODUCTS={choice!r}: use 0 (off), 1 (on) or leave it unset (by the CPU)")
    if choice == "0" or _isa() != "AVX512":
        return False
    if choice == "1":
        return True

    def reports(name: str) -> bool:  # (private torch queries: a torch without them keeps float32)
        return getattr(torch.cpu, name, lambda: False)()

    if reports("_is_amx_tile_supported"):
        return True
    return reports("_is_avx512_bf16_supported") and bf16_matmul_speedup() >= 1.25


@functools.cache
def bf16_matmul_speedup(size: int = 512, repeats: int = 8) -> float:
    """torch's bfloat16 matmul rate over its float32 rate on this CPU, once per process.

    The fastest of ``repeats`` (size, size) products in each dtype, the two dtypes alternating after
    two warm-up rounds (the first calls of a process also start the thread pool), with the current
    threads (about 40 ms at the default 512). The ratios it separates are far apart (Zen 4 2-3, an
    Intel Xeon without AMX 0.5-0.7), so a busy machine does not flip the choice it feeds.
    """
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, size, size, generator=gen)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    fastest = dict.fromkeys(pairs, float("inf"))
    for round_ in range(repeats + 2):
        for dtype, (x, y) in pairs.items():
            start = time.perf_counter()
            torch.mm(x, y)
            if round_ >= 2:
                fastest[dtype] = min(fastest[dtype], time.perf_counter() - start)
    return fastest[torch.float32] / fastest[torch.bfloat16]


def read_ahead() -> bool:
    """Whether the kernels read a thread's next small head's rows into L2 while it computes the head
    before (q, k, v in the forward; q, dout, out, k, v in the backward; heads whose rows fit in L2).

    Decided once per process when the kernel loads: ``MITA_READ_AHEAD=0`` / ``=1`` turn it off / on,
    else it is on where :func:`read_ahead_speedup` measures it faster. It changes no result, only time,
    and neither the vendor nor the cache sizes say which way: the forward at N = 197 took 0.91-0.96 of
    the time with it on AMD Zen 4 (1 MiB L2 a core) and 1.02-1.03 on an Intel Xeon without AMX (2 MiB),
    whose prefetchers already keep up (docs/performance.md, "Changes kept").
    """
    choice = os.environ.get("MITA_READ_AHEAD", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"MITA_READ_AHEAD={choice!r}: use 0 (off), 1 (on) or leave it unset (measured)")
    return choice == "1" if choice else read_ahead_speedup() >= 1.0


@functools.cache
def read_ahead_speedup(rounds: int = 15) -> float:
    """The fused forward's median time without the read-ahead over its time with it, on this CPU, once
    per process: the small heads of DeiT-S at 224 px (H = 6, N = 197, D = 64, m = k = 25 given
    landmarks; B = 8, or enough for two heads a thread), the two settings alternating call by call after
    two warm-up rounds, with the current threads (about 70 ms at two threads). A choice within this
    noise (a few percent) costs no more than the noise. Leaves the setting as it found it. Real tensors
    and kernels even when the first call comes under a tracing mode (``FakeTensorMode``, ``torch.compile``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    before = torch.ops.mita.read_ahead()
    times: dict[bool, list[float]] = {True: [], False: []}
    with _disable_current_modes():
        gen = torch.Generator().manual_seed(0)
        batch = max(8, -(-2 * torch.get_num_threads() // 6))  # >= two heads a thread: the schedule that reads ahead
        q, k, v = torch.randn(3, batch, 6, 197, 64, generator=gen, device="cpu")
        landmarks = torch.randn(batch, 6, 25, 64, generator=gen, device="cpu")
    try:
        for round_ in range(rounds + 2):
            for on in times:
                torch.ops.mita.read_ahead(on)
                start = time.perf_counter()
                with _disable_current_modes():
                    torch.ops.mita.fused_forward(q, k, v, landmarks, None, None, 25, 1, 0.125, 0.125)
                if round_ >= 2:
                    times[on].append(time.perf_counter() - start)
    finally:
        torch.ops.mita.read_ahead(before)
    return statistics.median(times[False]) / statistics.median(times[True])


def kernel_choices() -> dict[str, bool] | None:
    """What the loaded kernel decided for this machine, for reports: ``bf16_products``
    (:func:`bf16_products`) and ``read_ahead`` (:func:`read_ahead`); None until it has loaded, or where
    it cannot."""
    if not _state.get("ok") or "read_ahead" not in _state:
        return None
    return {"bf16_products": bf16_products(), "read_ahead": bool(torch.ops.mita.read_ahead())}


def _cflags() -> list[str]:
    isa = _isa()
    defines = [] if isa == "DEFAULT" else [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    if bf16_products():
        defines.append("-DMITA_BF16_PRODUCTS")
    return ["-O3", "-fopenmp", *_ISA_FLAGS.get(isa, []), *defines]


def cache_root() -> Path:
    """``$MITA_CACHE`` (``~`` expanded), else ``$XDG_CACHE_HOME/mita``, else ``~/.cache/mita``."""
    root = os.environ.get("MITA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "mita"
    return Path(root).expanduser()


def sources() -> list[Path]:
    """The kernel's files: :data:`SOURCE` and the headers in its folder."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


def cache_dir() -> Path:
    """Where the compiled kernel lives: one folder per build.

    Keyed by everything that makes two builds differ (the source, torch's version and
    install, Python's headers, the compiler, the flags), never by the checkout: the source
    is copied into the folder and compiled there, so checkouts and virtual environments
    that share a cache reuse each other's builds instead of rebuilding in turn.
    """
    key = {
        "source": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sources()},
        "torch": [torch.__version__, str(Path(torch.__file__).resolve().parent)],
        "python": sysconfig.get_paths()["include"],
        "compiler": shutil.which(os.environ.get("CXX", "c++")) or os.environ.get("CXX", "c++"),
        "flags": _cflags(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"kernels-torch{torch.__version__}-{_isa()}-{digest}"


def unsafe_reason(path: Path) -> str | None:
    """Why ``path`` (a cache folder or a file in it) cannot be trusted, None if it can.

    Like pip's cache: it must belong to this user and not be world-writable, or another
    user could swap the compiled kernel for code of their own, which loading would run.
    """
    if not hasattr(os, "getuid"):  # Windows: no POSIX owners or modes
        return None
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} is owned by another user (uid {st.st_uid})"
    if st.st_mode & stat.S_IWOTH:
        return f"{path} is writable by every user (mode {stat.filemode(st.st_mode)})"
    return None


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the fused CPU kernel is loaded (compiling it on the first call).

    Under ``torch.compile`` this runs once at trace time, outside the graph, and its answer is a
    constant of the graph: the lock and the build are host-side setup, never traced.
    """
    with _lock:
        if "ok" not in _state:
            _state["why"] = _load()
            _state["ok"] = _state["why"] is None
        if _state["ok"] and "read_ahead" not in _state:  # (a bad MITA_READ_AHEAD raises on every call)
            _state["read_ahead"] = torch.ops.mita.read_ahead(read_ahead())
    return bool(_state["ok"])


def unavailable_reason() -> str | None:
    """Why the kernel is not available (None if it is), after :func:`available` said so."""
    return _state.get("why")


def empty_cache() -> int:
    """Give the freed blocks the kernels keep (outputs, scratch) back to the system; returns how many bytes that was."""
    if not available():
        return 0
    held, limit = torch.ops.mita.kept_memory()
    torch.ops.mita.kept_memory(0)
    torch.ops.mita.kept_memory(limit)
    return held


def _load() -> str | None:
    """Load (building if needed) the kernel; returns why it could not, or None."""
    if os.environ.get("MITA_FUSED", "1") == "0":
        return "MITA_FUSED=0 switches it off"
    try:
        build = cache_dir()
        for folder in (build.parent, build):
            folder.mkdir(mode=0o700, exist_ok=True, parents=True)
        unsafe = [r for p in (build.parent, build, *build.glob("*.so")) if (r := unsafe_reason(p))]
        if unsafe:
            why = (
                f"the kernel cache is not safe to load code from: {'; '.join(unsafe)}. Use a folder of your own "
                "(set MITA_CACHE, or fix it with chown / chmod go-w)"
            )
            warnings.warn(f"mita: {why}; MiTA uses the pure-PyTorch grouped path", RuntimeWarning, stacklevel=3)
            return why
        for file in sources():  # compiled from inside the cache: no checkout path in the build files
            copy = build / file.name
            if not copy.exists() or copy.read_bytes() != file.read_bytes():
                shutil.copyfile(file, copy)
        _build_and_load(build, build / SOURCE.name)
        torch.library.register_fake("mita::fused_forward")(_fake_forward)
        torch.library.register_fake("mita::fused_backward")(_fake_backward)
        return None
    except Exception as err:  # no compiler, no ninja, no BLAS symbols, ...
        why = f"it could not be built ({type(err).__name__}: {err})"
        warnings.warn(
            f"mita: the fused CPU kernel is not used: {why}; MiTA uses the pure-PyTorch grouped path "
            "(set MITA_FUSED=0 to silence this)",
            RuntimeWarning,
            stacklevel=3,
        )
        return why


def _whole_library(so: Path) -> bool:
    """Whether ``so`` is a whole ELF library, read from its header without loading it (loading runs
    its static initializers: another build's would register the ``mita`` operators a second time,
    which aborts the process). The section header table is written last, so a truncated file ends
    before it; an empty or garbage file has no ELF header. Outside Linux: not empty."""
    if sys.platform != "linux":
        return so.stat().st_size > 0
    head = so.read_bytes()[:64]
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # ELF, 64-bit
        return False
    order = "little" if head[5] == 1 else "big"
    shoff, shentsize, shnum = (int.from_bytes(head[a:b], order) for a, b in ((0x28, 0x30), (0x3A, 0x3C), (0x3C, 0x3E)))
    return shoff > 0 and shoff + shentsize * shnum <= so.stat().st_size


def _build_and_load(build: Path, source: Path) -> None:
    """torch's JIT build into ``build`` (ninja skips it when the .so is up to date), then load it.

    The library is named after the folder (its key): torch renames a second build of one name in a
    process (``name_v1.so``, e.g. after a failed build elsewhere), and a folder holding two builds of
    the operators would be a trap for any check that loads them."""
    cuda_note = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found": not ours
    level, cuda_note.level = cuda_note.level, logging.ERROR
    try:
        from torch.utils.cpp_extension import load
    finally:
        cuda_note.setLevel(level)

    name = f"mita_fused_{_isa().lower()}_{build.name.rsplit('-', 1)[-1]}"
    so = build / f"{name}.so"
    if so.exists() and not _whole_library(so):  # an empty or truncated .so (a full disk, a killed copy)
        for f in (so, *build.glob("*.o")):  # looks up to date to ninja: rebuild it
            f.unlink()
    before = so.stat().st_mtime_ns if so.exists() else None
    if before is None:
        print(f"mita: compiling the fused CPU kernel once (1-3 minutes; cached in {build})", file=sys.stderr)
    # torch runs `ninja` from PATH: make this environment's scripts folder (pip's ninja) findable.
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    load(
        name=name,
        sources=[str(source)],
        build_directory=str(build),
        extra_cflags=_cflags(),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    if before is not None and so.stat().st_mtime_ns != before:
        print(f"mita: recompiled the fused CPU kernel (its build files had changed; in {build})", file=sys.stderr)


def _fake_forward(
    q,
    k,
    v,
    landmarks,
    key_mask,
    query_mask,
    topk,
    num_routed,
    scale,
    landmark_scale,
    offsets=None,
    tokens=None,
    key_offset=None,
):
    """Output shapes without computing, for tracing (``torch.compile``, FakeTensor)."""
    B, H, Nq, D = q.shape
    m, long, c = (landmarks.shape[2] if landmarks is not None else offsets.shape[0] - 1), torch.long, _compute(q.dtype)
    return [
        q.new_empty(B, Nq, H, D).transpose(1, 2),  # written as (B, N, H, D), like SDPA's CPU kernel
        q.new_empty(B, H, m, topk, dtype=long),
        q.new_empty(B, H, Nq, num_routed, dtype=long),
        q.new_empty(B, H, m, D, dtype=c),
        q.new_empty(B, H, m, D, dtype=c),
        q.new_empty(B, H, m, dtype=c),
        q.new_empty(B, H, Nq, dtype=c),
    ]


def _compute(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in for inputs of ``dtype`` (that of the landmarks, v~ and the
    log-sum-exps): float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fake_backward(dout, q, k, v, landmarks, *_):
    """Gradient shapes without computing: q's, k's, v's and the landmarks'."""
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), landmarks.new_empty(landmarks.shape)]


class _FusedMiTA(torch.autograd.Function):
    """The kernels' forward and backward as one autograd node (experts and routes carry no gradient).

    Without given landmarks the kernel pools them from q itself (``bins``), in cache with the
    rest of each head, and its backward adds their gradient into q's; the pooled landmarks are
    an output that gradients may reach too. The kernel's backward is not itself differentiable:
    when a graph of the gradient is asked for (``create_graph=True``, double backward), the
    gradient is taken through the grouped path instead, whose every step autograd can
    differentiate again.
    """

    @staticmethod
    def forward(ctx, q, k, v, landmarks, cfg: MiTAConfig, bins):
        out, experts, routes, pooled, v_shared, lse_a, lse_t = _fused_forward(q, k, v, landmarks, cfg, bins)
        offsets, tokens = bins if landmarks is None else (None, None)
        used = pooled if landmarks is None else landmarks  # the kernel's copy of given ones is no graph node
        ctx.save_for_backward(q, k, v, used, experts, routes, out, v_shared, lse_a, lse_t)
        ctx.cfg, ctx.bins = cfg, (offsets, tokens)
        ctx.mark_non_differentiable(experts, routes)
        ctx.set_materialize_grads(False)  # an unused pooled-landmarks output sends no zeros back
        return out, pooled, experts, routes

    @staticmethod
    def backward(ctx, dout, dpooled, _experts, _routes):
        q, k, v, landmarks, experts, routes, out, v_shared, lse_a, lse_t = ctx.saved_tensors
        cfg, (offsets, tokens) = ctx.cfg, ctx.bins
        pooled_here = offsets is not None
        dout = torch.zeros_like(out) if dout is None else dout
        dpooled = dpooled if pooled_here else None
        if torch.is_grad_enabled():  # double backward: differentiate a differentiable recomputation
            # Views: new graph nodes, so that each gradient is the partial derivative through its own
            # input (landmarks pooled from q must not add their path into q's gradient here).
            inputs = [t.view_as(t) for t in (q, k, v, landmarks)]
            needed = ctx.needs_input_grad[:4]
            wanted = [t for t, n in zip(inputs, needed) if n]
            given = None if pooled_here else inputs[3]
            recomputed, (lm, _, _) = mita_attention_grouped(*inputs[:3], cfg, landmarks=given)
            outputs, grads_out = [recomputed], [dout]
            if pooled_here and dpooled is not None:
                outputs, grads_out = [recomputed, lm], [dout, dpooled]
            grads = iter(torch.autograd.grad(outputs, wanted, grads_out, create_graph=True, allow_unused=True))
            return *(next(grads) if n else None for n in needed), None, None
        with torch.no_grad():
            grads = torch.ops.mita.fused_backward(
                _rows(dout),
                q,
                k,
                v,
                landmarks,
                *_masks(cfg),
                experts,
                routes,
                out,
                v_shared,
                lse_a,
                lse_t,
                cfg.scale,
                cfg.landmark_scale,
                offsets,
                tokens,
                None if dpooled is None else dpooled.contiguous(),
                _key_offset(cfg, q.dtype),
            )
        dq, dk, dv, dl = grads
        return dq, dk, dv, None if pooled_here else dl, None, None


def _fused_forward(q, k, v, landmarks, cfg: MiTAConfig, bins) -> tuple[torch.Tensor, ...]:
    """The kernel's forward: (out, experts, routes, pooled landmarks, v_shared, lse_a, lse_t); it pools
    the landmarks itself by ``bins`` (offsets, tokens) when none are given."""
    offsets, tokens = bins if landmarks is None else (None, None)
    return torch.ops.mita.fused_forward(
        q,
        k,
        v,
        landmarks,
        *_masks(cfg),
        cfg.topk,
        cfg.num_routed,
        cfg.scale,
        cfg.landmark_scale,
        offsets,
        tokens,
        _key_offset(cfg, q.dtype),
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself when its rows (last dimension) are contiguous and apart, whatever its other strides, else
    a copy: the kernels read any such layout (q, k, v of a timm block are views of one qkv buffer), but
    not rows of stride 0 (a tensor expanded along the tokens, as the gradient of a mean over them)."""
    return t if t.stride(-1) == 1 and t.stride(-2) >= t.size(-1) else t.contiguous()


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, each one passed again (q is k is v) as a view of it: ``torch.compile`` traces an
    autograd.Function only if no tensor is two of its inputs (a view costs no copy)."""
    return [t.view_as(t) if any(t is u for u in tensors[:i]) else t for i, t in enumerate(tensors)]


def _key_offset(cfg: MiTAConfig, dtype: torch.dtype) -> torch.Tensor | None:
    """Merged duplicates' key offsets (B, Hkv, Nk) as the kernels take them (contiguous, in the compute
    dtype), or None."""
    return None if cfg.key_offset is None else cfg.key_offset.to(_compute(dtype)).contiguous()


def _masks(cfg: MiTAConfig) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The key and query padding masks, contiguous, as the kernels take them."""
    return tuple(None if m is None else m.contiguous() for m in (cfg.key_mask, cfg.query_mask))


def not_supported_reasons(q: torch.Tensor, cfg: MiTAConfig, dropout_p: float) -> list[str]:
    """Why a call cannot take the fused kernels (an empty list: it can)."""
    reasons = []
    if q.device.type != "cpu":
        reasons.append(f"q is on {q.device}, the fused kernels run on CPU")
    if dropout_p > 0:
        reasons.append(f"dropout_p={dropout_p} (the fused kernels have no dropout)")
    if cfg.branches != "both":
        reasons.append(f"branches={cfg.branches!r} (the fused kernels compute both branches)")
    return reasons


def mita_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: MiTAConfig,
    landmarks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """MiTA by the fused CPU kernels, forward and backward; returns (out, (landmarks, experts, routes)).

    bfloat16 and float16 inputs are read by the kernels as they are and computed in float32 (see
    the module's docstring); the output and gradients are in the input dtype, the pooled landmarks
    rounded to it.
    """
    reasons = not_supported_reasons(q, cfg, dropout_p)
    if reasons:
        raise ValueError(f"impl='fused' cannot run this call: {'; '.join(reasons)}; use impl='grouped'")
    if not available():
        raise RuntimeError(f"impl='fused': the fused CPU kernel is not available: {unavailable_reason()}")
    q, k, v = zero_padding(q, k, v, cfg)  # padded tokens take no part anywhere
    bins = None
    if landmarks is None:
        if cfg.query_mask is None and not torch.compiler.is_compiling():  # the kernel pools, per head in cache
            bins = pool_bins(cfg.pooling, q.shape[2])  # (traced code pools in Python: no cached tensors in graphs)
        else:
            landmarks = pool(q, cfg.pooling, cfg.query_mask)
    q_, k_, v_ = (_rows(t) for t in (q, k, v))  # half precision passes as it is: no copies
    given = None if landmarks is None else landmarks.to(_compute(q.dtype)).contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, landmarks)):
        out, pooled, experts, routes = _FusedMiTA.apply(*_distinct([q_, k_, v_]), given, cfg, bins)
    else:  # no graph to record (inference): the kernel alone, without the autograd.Function's cost a call
        out, experts, routes, pooled, *_ = _fused_forward(q_, k_, v_, given, cfg, bins)
    return out, (pooled.to(q.dtype) if landmarks is None else landmarks, experts, routes)
