"""Fused MiTA on CPU: C++ forward and backward kernels (``csrc/fused_cpu.cpp``).

The forward runs the grouped algorithm block by block in cache (no grouped buffers, no
Python-side bookkeeping) and calls the BLAS that PyTorch links for every matrix product;
it saves only the shared values and two log-sum-exps, from which the backward recomputes
the probabilities it needs, like flash attention.
It is compiled on first use with the compiler already on the machine and cached in
``$MITA_CACHE`` (default ``~/.cache/mita``), keyed by torch version and CPU capability,
so a user waits once. ``MITA_FUSED=0`` turns it off; if it cannot be built, MiTA falls
back to the pure-PyTorch grouped path with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
import threading
import warnings
from pathlib import Path

import torch

from ..pooling import pool
from ..tiling import zero_padding
from .config import MiTAConfig

SOURCE = Path(__file__).with_name("csrc") / "fused_cpu.cpp"
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()
_state: dict[str, object] = {}


def _isa() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return "AVX512" if cap.startswith("AVX512") else "AVX2" if cap == "AVX2" else "DEFAULT"


def cache_dir() -> Path:
    """Where the compiled kernel lives: one folder per torch version, CPU capability and source."""
    root = Path(os.environ.get("MITA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mita")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return root / f"kernels-torch{torch.__version__}-{_isa()}-{digest}"


def available() -> bool:
    """Whether the fused CPU kernel is loaded (compiling it on the first call)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
    return bool(_state["ok"])


def _load() -> bool:
    if os.environ.get("MITA_FUSED", "1") == "0":
        return False
    try:
        cuda_note = logging.getLogger("torch.utils.cpp_extension")  # "No CUDA runtime is found": not ours
        level, cuda_note.level = cuda_note.level, logging.ERROR
        try:
            from torch.utils.cpp_extension import load
        finally:
            cuda_note.setLevel(level)

        build = cache_dir()
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            print(f"mita: compiling the fused CPU kernel once (about 25 s; cached in {build})", file=sys.stderr)
        # torch runs `ninja` from PATH: make this environment's scripts folder (pip's ninja) findable.
        scripts = sysconfig.get_path("scripts")
        if scripts not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        isa = _isa()
        defines = [] if isa == "DEFAULT" else [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
        load(
            name=f"mita_fused_{isa.lower()}",
            sources=[str(SOURCE)],
            build_directory=str(build),
            extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS.get(isa, []), *defines],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        torch.library.register_fake("mita::fused_forward")(_fake_forward)
        torch.library.register_fake("mita::fused_backward")(_fake_backward)
        return True
    except Exception as err:  # no compiler, no ninja, no BLAS symbols, ...
        warnings.warn(
            f"mita: the fused CPU kernel could not be built ({type(err).__name__}: {str(err)[:300]}); "
            "MiTA uses the pure-PyTorch grouped path (set MITA_FUSED=0 to silence this)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False


def _fake_forward(q, k, v, landmarks, key_mask, query_mask, topk, num_routed, scale, landmark_scale):
    """Output shapes without computing, for tracing (``torch.compile``, FakeTensor)."""
    B, H, Nq, D = q.shape
    m, long = landmarks.shape[2], torch.long
    return [
        q.new_empty(q.shape),
        q.new_empty(B, H, m, topk, dtype=long),
        q.new_empty(B, H, Nq, num_routed, dtype=long),
        q.new_empty(B, H, m, D),
        q.new_empty(B, H, m),
        q.new_empty(B, H, Nq),
    ]


def _fake_backward(dout, q, k, v, landmarks, *_):
    """Gradient shapes without computing: q's, k's, v's and the landmarks'."""
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), landmarks.new_empty(landmarks.shape)]


class _FusedMiTA(torch.autograd.Function):
    """The kernel's forward and backward as one autograd node (experts and routes carry no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, landmarks, key_mask, query_mask, topk, num_routed, scale, landmark_scale):
        out, experts, routes, v_shared, lse_a, lse_t = torch.ops.mita.fused_forward(
            q, k, v, landmarks, key_mask, query_mask, topk, num_routed, scale, landmark_scale
        )
        ctx.save_for_backward(q, k, v, landmarks, key_mask, query_mask, experts, routes, out, v_shared, lse_a, lse_t)
        ctx.args = (scale, landmark_scale)
        ctx.mark_non_differentiable(experts, routes)
        return out, experts, routes

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _experts, _routes):
        q, k, v, landmarks, key_mask, query_mask, experts, routes, out, v_shared, lse_a, lse_t = ctx.saved_tensors
        scale, landmark_scale = ctx.args
        grads = torch.ops.mita.fused_backward(
            dout.contiguous(),
            q,
            k,
            v,
            landmarks,
            key_mask,
            query_mask,
            experts,
            routes,
            out,
            v_shared,
            lse_a,
            lse_t,
            scale,
            landmark_scale,
        )
        return *grads, None, None, None, None, None, None


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

    bfloat16 and float16 are computed in float32 (the kernels' products and softmaxes) and the
    output cast back, which is at least as precise as the grouped path's half-precision products.
    """
    reasons = not_supported_reasons(q, cfg, dropout_p)
    if reasons:
        raise ValueError(f"impl='fused' cannot run this call: {'; '.join(reasons)}; use impl='grouped'")
    if not available():
        raise RuntimeError("impl='fused': the fused CPU kernel is not available (see the warning above)")
    q, k, v = zero_padding(q, k, v, cfg)  # padded tokens take no part anywhere
    if landmarks is None:
        landmarks = pool(q, cfg.pooling, cfg.query_mask)
    compute = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    key_mask, query_mask = (None if m is None else m.contiguous() for m in (cfg.key_mask, cfg.query_mask))
    out, experts, routes = _FusedMiTA.apply(
        *(t.to(compute).contiguous() for t in (q, k, v, landmarks)),
        key_mask,
        query_mask,
        cfg.topk,
        cfg.num_routed,
        cfg.scale,
        cfg.landmark_scale,
    )
    return out.to(q.dtype), (landmarks, experts, routes)
