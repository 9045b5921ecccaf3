"""Linear attention with the elu+1 feature map (Katharopoulos et al. 2020, "Transformers are RNNs").

out_i = phi(q_i) . sum_j phi(k_j) v_j^T / phi(q_i) . sum_j phi(k_j), phi(x) = elu(x) + 1.
The whole context is compressed into one D x D state: the taxonomy's single shared
linear expert. The reference builds the (Nq, Nk) matrix phi(Q) phi(K)^T; the efficient
path never does (O(N D^2) time, O(D^2) state; causal: chunked running sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_causal, checked_inputs, chunk_rows, grouped_heads, zero_padded
from .kernelized import mask_features


def feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0."""
    return F.elu(x) + 1


def _features(q, k, v, key_padding_mask, query_padding_mask, dropout_p, causal, is_causal):
    """Checked inputs: phi(q) and phi(k) with padded rows zero, v with padded rows zero, the config and
    the causal flag.

    The padded slots are zeroed before phi (phi(NaN) is NaN, and so is its zero gradient times
    phi'(NaN)) and their features after (phi(0) = 1); a padded value must be zero, not merely
    weighed by phi(k) = 0, as 0 * inf is NaN.
    """
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p)
    if dropout_p:
        raise ValueError(f"linear attention has no attention matrix to drop out; use dropout_p=0, got {dropout_p!r}")
    causal = check_causal(causal, is_causal, q, k)
    qf, kf = mask_features(feature_map(q), feature_map(k), cfg)  # padded keys contribute nothing
    return qf, kf, v, cfg, causal


def _normalise(num: torch.Tensor, den: torch.Tensor, cfg) -> torch.Tensor:
    """num / den; padded query rows (num = den = 0) become zero rather than NaN."""
    if cfg.query_mask is not None:
        den = den + (~cfg.query_mask[:, None, :, None]).to(den.dtype)
    return zero_padded(num / den, cfg)


def linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    is_causal: bool = False,
) -> torch.Tensor:
    """The matrix form: S = phi(Q) phi(K)^T (lower-triangular if causal), out = S V / S 1."""
    qf, kf, v, cfg, causal = _features(q, k, v, key_padding_mask, query_padding_mask, dropout_p, causal, is_causal)
    G = q.shape[1] // k.shape[1]
    S = qf @ kf.repeat_interleave(G, dim=1).transpose(-1, -2)
    if causal:
        S = S.tril()
    return _normalise(S @ v.repeat_interleave(G, dim=1), S.sum(-1, keepdim=True), cfg)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    is_causal: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Linear attention on (B, H, N, D) tensors in O(N D^2) time.

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.
        causal (bool): query i sees keys j <= i, by running sums over chunks (needs Nq == Nk). Default: False.
        is_causal (bool): the same, under SDPA's name (layers pass it). Default: False.
        chunk_size (int | None): tokens per chunk of the causal form; None picks 64. Default: None.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    qf, kf, v, cfg, causal = _features(q, k, v, key_padding_mask, query_padding_mask, dropout_p, causal, is_causal)
    B, H, Nq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    qg = grouped_heads(qf, Hkv)
    if not causal:
        state = (kf.transpose(-1, -2) @ v).unsqueeze(2)  # (B, Hkv, 1, D, Dv)
        num = qg @ state
        den = qg @ kf.sum(2)[:, :, None, :, None]
        return _normalise(num.view(B, H, Nq, Dv), den.view(B, H, Nq, 1), cfg)
    step = chunk_rows(Nq, 1, 64 if chunk_size is None else chunk_size)
    state = q.new_zeros(B, Hkv, 1, D, Dv)
    total = q.new_zeros(B, Hkv, 1, D, 1)
    nums, dens = [], []
    for start in range(0, Nq, step):
        qc, kc, vc = (
            qg[:, :, :, start : start + step],
            kf[:, :, None, start : start + step],
            v[:, :, None, start : start + step],
        )
        local = (qc @ kc.transpose(-1, -2)).tril()  # within the chunk: j <= i
        nums.append(qc @ state + local @ vc)
        dens.append(qc @ total + local.sum(-1, keepdim=True))
        state = state + kc.transpose(-1, -2) @ vc
        total = total + kc.sum(3).unsqueeze(-1)
    num, den = torch.cat(nums, dim=3), torch.cat(dens, dim=3)
    return _normalise(num.view(B, H, Nq, Dv), den.view(B, H, Nq, 1), cfg)


def linear_flops(n: int, d: int, **_: object) -> float:
    """phi(K)^T V and phi(Q) times it (2 N D^2 each), plus the normaliser (4 N D)."""
    return 4 * n * d * d + 4 * n * d
