"""Nyströmformer (Xiong et al. 2021): softmax attention through m segment-mean landmarks.

softmax(Q K^T) is approximated by F A^+ B with F = softmax(s Q K~^T) (N x m),
A = softmax(s Q~ K~^T) (m x m) and B = softmax(s Q~ K^T) (m x N), where Q~ and K~ are
the means of m contiguous segments of the queries and keys, and A^+ is the
Moore-Penrose pseudo-inverse computed by the paper's iteration (6 steps). The
reference builds the (Nq, Nk) approximate attention matrix; the efficient path
multiplies right to left, O(N m D + m^3).
"""

from __future__ import annotations

import torch

from .checks import AttentionArgs
from .common import checked_inputs, real_keys, softmax_allowed, zero_padded
from .pooling import Pooling, check_pooling, pool, pool_reference


def iterative_pinv(a: torch.Tensor, iterations: int | None = 6) -> torch.Tensor:
    """Pseudo-inverse of a batch of square matrices.

    The Nyströmformer iteration: Z0 = A^T / (||A||_1 ||A||_inf),
    Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4. ``iterations=None``: exact
    ``torch.linalg.pinv`` (for tests and for checking the approximation). Half-precision
    matrices are inverted in float32.
    """
    if a.dtype in (torch.float16, torch.bfloat16):  # the iteration needs float32's precision
        return iterative_pinv(a.float(), iterations).to(a.dtype)
    if iterations is None:
        return torch.linalg.pinv(a)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm_1 = a.abs().sum(-2).amax(-1, keepdim=True)[..., None]
    norm_inf = a.abs().sum(-1).amax(-1, keepdim=True)[..., None]
    z = a.transpose(-1, -2) / (norm_1 * norm_inf)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _check(
    q, k, v, num_landmarks, key_padding_mask, query_padding_mask, dropout_p, scale, pinv_iterations
) -> tuple[AttentionArgs, Pooling, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked arguments, the pooling, and q, k, v with padded slots zero.

    Zeroed, not weighted by the mask (0 * NaN is NaN): a padded query or key would reach
    every landmark through the segment means, a padded key or value every landmark's values.
    """
    args, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    pooling = check_pooling(num_landmarks, None, 0, q.shape[2])
    if dropout_p:
        raise ValueError(f"nystrom attention supports no attention dropout; use dropout_p=0, got {dropout_p!r}")
    if pinv_iterations is not None and (
        isinstance(pinv_iterations, bool) or not isinstance(pinv_iterations, int) or pinv_iterations < 1
    ):
        raise ValueError(
            f"pinv_iterations must be an int >= 1, or None for the exact pseudo-inverse, got {pinv_iterations!r}"
        )
    return args, pooling, q, k, v


def nystrom_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_landmarks: int,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    pinv_iterations: int | None = 6,
) -> torch.Tensor:
    """The approximate (Nq, Nk) attention matrix F A^+ B, built explicitly, times V."""
    cfg, pooling, q, k, v = _check(
        q, k, v, num_landmarks, key_padding_mask, query_padding_mask, dropout_p, scale, pinv_iterations
    )
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    q_land = pool_reference(q, pooling, cfg.query_mask)  # segment means of the real queries
    k_land = pool_reference(k, pooling, cfg.key_mask)
    kernel_f = softmax_allowed(cfg.scale * q @ k_land.transpose(-1, -2), None)
    kernel_a = softmax_allowed(cfg.scale * q_land @ k_land.transpose(-1, -2), None)
    kernel_b = softmax_allowed(cfg.scale * q_land @ k.transpose(-1, -2), real_keys(cfg))
    attn = kernel_f @ iterative_pinv(kernel_a, pinv_iterations) @ kernel_b
    return zero_padded(attn @ v, cfg)


def nystrom_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_landmarks: int,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    pinv_iterations: int | None = 6,
) -> torch.Tensor:
    """Nyström attention on (B, H, N, D) tensors in O(N m D + m^3) time and O(N m) memory.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        num_landmarks (int): m, the segments whose means are the landmarks (bins of adaptive_avg_pool1d
            over the real tokens).
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0. Default: 0.0.
        scale (float | None): logit scale, positive and finite. Default: D**-0.5.
        pinv_iterations (int | None): steps of the pseudo-inverse iteration (paper: 6); None = exact pinv.
            Default: 6.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, pooling, q, k, v = _check(
        q, k, v, num_landmarks, key_padding_mask, query_padding_mask, dropout_p, scale, pinv_iterations
    )
    B, H, _, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, m = H // Hkv, pooling.m
    q_land = pool(q, pooling, cfg.query_mask)  # (B, H, m, D)
    k_land = pool(k, pooling, cfg.key_mask).repeat_interleave(G, dim=1)
    kernel_f = softmax_allowed(cfg.scale * q @ k_land.transpose(-1, -2), None)  # (B, H, Nq, m)
    kernel_a = softmax_allowed(cfg.scale * q_land @ k_land.transpose(-1, -2), None)  # (B, H, m, m)
    logits_b = (q_land.reshape(B, Hkv, G * m, D) @ k.transpose(-1, -2)).view(B, H, m, Nk)
    kernel_b = softmax_allowed(cfg.scale * logits_b, real_keys(cfg))
    bv = (kernel_b.view(B, Hkv, G * m, Nk) @ v).view(B, H, m, D)  # the landmarks' values
    return zero_padded(kernel_f @ (iterative_pinv(kernel_a, pinv_iterations) @ bv), cfg)


def nystrom_flops(n: int, d: int, num_landmarks: int = 64, pinv_iterations: int | None = 6, **_: object) -> float:
    """F, B and their products with values (8 N m D), A and A^+ BV (4 m^2 D), 8 m^3 per pinv step."""
    m = num_landmarks
    return 8 * n * m * d + 4 * m * m * d + 8 * (pinv_iterations or 0) * m**3
