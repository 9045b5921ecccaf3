"""MiTA on GPUs: the joint softmax (step 6) as Triton kernels (``triton_kernels.py``).

Pooling, the affinities, the shared values, top-k and routing stay in PyTorch (O(m N) per
head). The joint softmax over [m landmarks ; the routed experts' keys] of every query runs
in one kernel over tiles of (query, expert) pairs sorted by expert, and its backward in
another, recomputing the probabilities from the saved log-sum-exp. Both are
``torch.library`` custom ops with fake implementations and a registered autograd, so
``torch.compile`` and fake tensors trace them. Nothing is read back to the host: the grid
is an upper bound on the number of tiles and spare programs exit.

On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported), which is how the tests check them without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from ..common import topk_indices
from ..pooling import pool
from ..tiling import tile_rows, zero_padded, zero_padding
from .config import MiTAConfig

MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # found once, without importing it
_warned: set[str] = set()


def available() -> bool:
    """Whether Triton is installed (it is imported when a kernel first runs)."""
    return _HAS_TRITON


def not_supported_reasons(q: torch.Tensor, cfg: MiTAConfig, dropout_p: float) -> list[str]:
    """Why a call cannot take the Triton kernels (an empty list: it can)."""
    reasons = []
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreting()):
        reasons.append(f"q is on {q.device}; the Triton kernels run on CUDA (on CPU only with TRITON_INTERPRET=1)")
    if q.dtype not in DTYPES:
        reasons.append(f"dtype {q.dtype} (the Triton kernels take float32, float16 and bfloat16)")
    if q.shape[-1] > MAX_HEAD_DIM:
        reasons.append(f"head dim D={q.shape[-1]} (the Triton kernels take D <= {MAX_HEAD_DIM})")
    if dropout_p > 0:
        reasons.append(f"dropout_p={dropout_p} (the Triton kernels have no dropout)")
    if cfg.branches != "both":
        reasons.append(f"branches={cfg.branches!r} (the Triton kernels compute both branches)")
    return reasons


def warn_once(message: str) -> None:
    """One warning per distinct message and process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def mita_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: MiTAConfig,
    landmarks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """MiTA with the joint softmax in Triton kernels; returns (out, (landmarks, experts, routes)).

    The affinities and the gate used for top-k and routing are computed in float32 whatever
    the input dtype; the kernels take the inputs' dtype and accumulate in float32.
    """
    reasons = not_supported_reasons(q, cfg, dropout_p)
    if reasons:
        raise ValueError(f"impl='triton' cannot run this call: {'; '.join(reasons)}; use impl='grouped'")
    if not available():
        raise RuntimeError("impl='triton' needs the triton package (pip install triton); use impl='grouped'")
    B, H, _, D = q.shape
    Hkv, G, m = k.shape[1], H // k.shape[1], cfg.m
    q, k, v = zero_padding(q, k, v, cfg)  # padded tokens take no part anywhere
    if landmarks is None:
        landmarks = pool(q, cfg.pooling, cfg.query_mask)
    A = SplitK.apply(landmarks.float().reshape(B, Hkv, G * m, D), k.float().transpose(-1, -2), SPLIT_K)  # unscaled
    if cfg.key_mask is not None:
        A = A.masked_fill(~cfg.key_mask[:, None, None, :], float("-inf"))
    v_shared = SplitK.apply(torch.softmax(cfg.scale * A, dim=-1), v.float(), SPLIT_K).to(q.dtype).view(B, H, m, D)
    experts = topk_indices(A.detach(), cfg.topk).view(B, H, m, cfg.topk)
    gate = q.detach().float() @ landmarks.detach().float().transpose(-1, -2)  # routing only
    routes = gate.argmax(-1, keepdim=True) if cfg.num_routed == 1 else topk_indices(gate, cfg.num_routed)
    key_mask = cfg.key_mask if cfg.short_keys else None
    out, _ = torch.ops.mita.triton_forward(
        q, k, v, landmarks, v_shared, experts, routes, key_mask, cfg.scale, cfg.landmark_scale
    )
    return zero_padded(out, cfg), (landmarks, experts, routes)


SPLIT_K = 1024  # reduction length of one piece in split_k_matmul


def split_k_matmul(a: torch.Tensor, b: torch.Tensor, block: int = SPLIT_K) -> torch.Tensor:
    """a (..., M, K) @ b (..., K, N), a long K cut into pieces of ``block`` done as one batched product, then summed.

    MiTA's shared-expert products reduce over the sequence (softmax(A) V: M = G m, N = D, K = N_k, and
    the landmarks' gradient dA K): a few small output tiles, each a loop over N_k. On an H200 cuBLAS
    ran softmax(A) V in float32 at N = 65,536 as 32 x 32 tiles, 2.4 ms for 4.3 GFLOP (profile in
    docs/performance.md); pieces give the GPU K / block times as many tiles to run at once.
    """
    K = a.shape[-1]
    c = K // block
    if c < 2:
        return a @ b
    cut = c * block
    pieces = a[..., :cut].unflatten(-1, (c, block)).movedim(-2, -3) @ b[..., :cut, :].unflatten(-2, (c, block))
    out = pieces.sum(-3)
    return out if cut == K else out + a[..., cut:] @ b[..., cut:, :]


class SplitK(torch.autograd.Function):
    """a @ b by :func:`split_k_matmul`, and its gradients by it too (whichever reduction is long)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.block = block
        return split_k_matmul(a, b, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        a, b = ctx.saved_tensors
        da = split_k_matmul(grad, b.transpose(-1, -2), ctx.block) if ctx.needs_input_grad[0] else None
        db = split_k_matmul(a.transpose(-1, -2), grad, ctx.block) if ctx.needs_input_grad[1] else None
        return da, db, None


def _blocks(q: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): small tiles in the interpreter (CPU), 64 on a GPU."""
    block_d = max(16, 1 << (q.shape[-1] - 1).bit_length())
    return (16, 16, block_d) if q.device.type == "cpu" else (64, 64 if block_d <= 128 else 32, block_d)


def _plan(routes: torch.Tensor, m: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tiles of (query, route) pairs grouped by expert: (slot of each pair, tile expert, pair of each row).

    Pair p = (query row of q flattened) * s + route rank; padding rows hold -1. The number of
    tiles is an upper bound (nothing read back to the host); spare tiles hold padding rows only.
    """
    B, H = routes.shape[:2]
    expert_id = (routes + torch.arange(B * H, device=routes.device).view(B, H, 1, 1) * m).reshape(-1)
    slot, tile_expert, T = tile_rows(expert_id, B * H * m, tile=block_m, bound=True)
    row_pair = torch.full((tile_expert.numel() * T,), -1, dtype=torch.long, device=routes.device)
    row_pair.scatter_(0, slot, torch.arange(slot.numel(), device=routes.device))
    return slot, tile_expert, row_pair


def _row_buffer(q: torch.Tensor, row_pair: torch.Tensor, s: int) -> torch.Tensor:
    """Where the kernels write a row of D per (query, route): with s = 1 the query rows themselves, in
    q's dtype (each query has one pair); else one float32 row per tile slot, merged after."""
    B, H, Nq, D = q.shape
    return q.new_empty(B * H * Nq, D) if s == 1 else q.new_empty(row_pair.numel(), D, dtype=torch.float32)


def _launch_args(q, k, v, landmarks, v_shared, experts, key_mask):
    """The kernels' shared arguments: contiguous tensors, sizes, constexprs."""
    H, D = q.shape[1], q.shape[3]
    Hkv, Nk, m, kk = k.shape[1], k.shape[2], landmarks.shape[2], experts.shape[3]
    block_m, block_n, block_d = _blocks(q)
    tensors = [t.contiguous() for t in (q, k, v, landmarks, v_shared, experts)]
    mask = experts if key_mask is None else key_mask.contiguous().view(torch.uint8)
    sizes = (Nk, H, H // Hkv, Hkv)
    meta = {
        "M": m,
        "KK": kk,
        "D": D,
        "HAS_MASK": key_mask is not None,
        "IEEE": q.dtype == torch.float32,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        "num_warps": 4 if block_d <= 64 else 8,
    }
    return tensors, mask, sizes, meta


@torch.library.custom_op("mita::triton_forward", mutates_args=())
def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    v_shared: torch.Tensor,
    experts: torch.Tensor,
    routes: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    landmark_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 6 by the forward kernel: the output (B, H, Nq, D) and its log-sum-exp (B, H, Nq), float32.

    q (B, H, Nq, D); k, v (B, Hkv, Nk, D); landmarks, v_shared (B, H, m, D); experts
    (B, H, m, k) key indices; routes (B, H, Nq, s) expert indices; key_mask (B, Nk) or None.
    """
    from .triton_kernels import mita_fwd_kernel

    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (set before import)")
    B, H, Nq, D = q.shape
    s = routes.shape[3]
    tensors, mask, sizes, meta = _launch_args(q, k, v, landmarks, v_shared, experts, key_mask)
    slot, tile_expert, row_pair = _plan(routes, meta["M"], meta["BLOCK_M"])
    o_part = _row_buffer(q, row_pair, s)
    lse_part = q.new_empty(o_part.shape[0], dtype=torch.float32)
    mita_fwd_kernel[(tile_expert.numel(),)](
        *tensors, mask, tile_expert, row_pair, o_part, lse_part, *sizes, scale, landmark_scale, S=s, **meta
    )
    if s == 1:
        return o_part.view(B, H, Nq, D), lse_part.view(B, H, Nq)
    o, lse = o_part[slot].view(B * H * Nq, s, D), lse_part[slot].view(B * H * Nq, s)
    merged = torch.logsumexp(lse, 1)  # merge the s partial softmaxes of each query by their log-sum-exps
    o = torch.einsum("rs,rsd->rd", torch.exp(lse - merged[:, None]), o)
    return o.view(B, H, Nq, D).to(q.dtype), merged.view(B, H, Nq)


@triton_forward.register_fake
def _(q, k, v, landmarks, v_shared, experts, routes, key_mask, scale, landmark_scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("mita::triton_backward", mutates_args=())
def triton_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    v_shared: torch.Tensor,
    experts: torch.Tensor,
    routes: torch.Tensor,
    key_mask: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    landmark_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`triton_forward` for q, k, v, the landmarks and the shared values."""
    from .triton_kernels import mita_bwd_kernel

    B, H, Nq, D = q.shape
    s = routes.shape[3]
    tensors, mask, sizes, meta = _launch_args(q, k, v, landmarks, v_shared, experts, key_mask)
    slot, tile_expert, row_pair = _plan(routes, meta["M"], meta["BLOCK_M"])
    dout = dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    dq_part = _row_buffer(q, row_pair, s)
    dk, dv = (k.new_zeros(k.shape, dtype=torch.float32) for _ in range(2))
    dlm, dvs = (q.new_zeros(landmarks.shape, dtype=torch.float32) for _ in range(2))
    mita_bwd_kernel[(tile_expert.numel(),)](
        *tensors,
        mask,
        tile_expert,
        row_pair,
        dout,
        lse.contiguous(),
        delta,
        dq_part,
        dk,
        dv,
        dlm,
        dvs,
        *sizes,
        scale,
        landmark_scale,
        S=s,
        **meta,
    )
    dq = dq_part.view(B, H, Nq, D) if s == 1 else dq_part[slot].view(B, H, Nq, s, D).sum(3).to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dlm.to(landmarks.dtype), dvs.to(v_shared.dtype)


@triton_backward.register_fake
def _(dout, q, k, v, landmarks, v_shared, *_):
    return tuple(torch.empty_like(t) for t in (q, k, v, landmarks, v_shared))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, landmarks, v_shared, experts, routes, key_mask, scale, landmark_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, landmarks, v_shared, experts, routes, key_mask, out, lse)
    ctx.scales = (scale, landmark_scale)


def _backward(ctx, dout, _dlse):
    saved = ctx.saved_tensors
    grads = torch.ops.mita.triton_backward(dout, *saved, *ctx.scales)
    return *grads, None, None, None, None, None


triton_forward.register_autograd(_backward, setup_context=_setup_context)
