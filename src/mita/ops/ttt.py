"""TTT-Linear, bidirectional (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive
Hidden States", arXiv 2407.04620; the bidirectional use of Han et al., "ViT^3: Unlocking Test-Time
Training in Vision", arXiv 2512.01643).

The hidden state is an inner linear model f(x) = x W (D x D per kv head, W_0 given: the layer
learns it). It is trained at test time on the keys and values: the self-supervised
reconstruction loss of a token is l_j(W) = 1/2 ||k_j W - v_j||^2, and the keys are taken in
mini-batches of ``mini_batch_size`` consecutive tokens, one gradient step per mini-batch on
the mean loss of its real tokens, in order (one epoch):
W_t = W_{t-1} - (lr / n_t) K_t^T (K_t W_{t-1} - V_t). Then every query reads the final model:
out_i = q_i W_T. That is the bidirectional form of ViT^3, whose study found one full-batch step
(the default, mini_batch_size = N) with learning rate 1 best for vision; a smaller
mini-batch makes it T sequential steps. TTT-Linear's layer norm and residual around f are
not included. Compression into one learned linear model (spec section 5).

The reference is the explicit inner loop: per-token gradients of the loss by ``torch.func``
(b D x D matrices a mini-batch, the primal form). The efficient path is the dual form: a
mini-batch's gradient is one product K_t^T E_t of its keys and errors E_t = K_t W_{t-1} - V_t,
with no per-token gradient ever formed; O(N D^2). With lr = 0 the output is Q W_0; with
W_0 = 0 and one full-batch step it is (lr / n) Q K^T V, unnormalised linear attention.
"""

from __future__ import annotations

import math
import numbers

import torch

from .checks import AttentionArgs, check_int
from .common import grouped_heads
from .kernelized import check_linear, finish


def check_inner_lr(inner_lr: object) -> float:
    """``inner_lr`` as a finite float >= 0."""
    if isinstance(inner_lr, bool) or not isinstance(inner_lr, numbers.Real):
        raise TypeError(f"inner_lr must be a float >= 0, got {type(inner_lr).__name__} {inner_lr!r}")
    if not (math.isfinite(inner_lr) and inner_lr >= 0):
        raise ValueError(f"inner_lr must be a finite float >= 0, got {inner_lr!r}")
    return float(inner_lr)


def inner_tensor(name: str, value: object, dims: tuple[tuple[str, int], ...], like: torch.Tensor) -> torch.Tensor:
    """An inner model's initial tensor: a float tensor broadcastable to ``dims``, (name, size) pairs such as
    Hkv, D, D, on ``like``'s device, returned as (1, *sizes) in ``like``'s dtype; it keeps its graph, so a
    layer can learn it."""
    shape = tuple(size for _, size in dims)
    want = "(" + ", ".join(f"{key}={size}" for key, size in dims) + ")"
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{name} must be a float tensor of shape {want}, got {type(value).__name__}")
    if value.device != like.device:
        raise ValueError(f"{name} is on {value.device} but q is on {like.device}")
    try:
        ok = torch.broadcast_shapes(value.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(value.shape)} must broadcast to {want}")
    return value.to(like.dtype).expand(shape)[None]


def check_ttt(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inner_lr: object,
    mini_batch_size: object,
    key_padding_mask: torch.Tensor | None,
    query_padding_mask: torch.Tensor | None,
    dropout_p: float,
) -> tuple[AttentionArgs, float, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the TTT ops share: the checked arguments, the learning rate, the mini-batch size (at most Nk)
    and q, k, v zero-padded in the accumulation dtype."""
    cfg, q32, k32, v32 = check_linear(name, q, k, v, key_padding_mask, query_padding_mask, dropout_p)
    lr = check_inner_lr(inner_lr)
    Nk = k.shape[2]
    b = Nk if mini_batch_size is None else check_int("mini_batch_size", mini_batch_size)
    return cfg, lr, min(b, Nk), q32, k32, v32


def _check(q, k, v, inner_lr, mini_batch_size, initial_weight, key_padding_mask, query_padding_mask, dropout_p):
    """Checked arguments, the learning rate, the mini-batch size, W_0 (1, Hkv, D, D) and q, k, v."""
    cfg, lr, b, q32, k32, v32 = check_ttt(
        "TTT-Linear", q, k, v, inner_lr, mini_batch_size, key_padding_mask, query_padding_mask, dropout_p
    )
    Hkv, D = k.shape[1], k.shape[3]
    if initial_weight is None:
        w0 = k32.new_zeros(1, Hkv, D, D)
    else:
        w0 = inner_tensor("initial_weight", initial_weight, (("Hkv", Hkv), ("D", D), ("D", D)), k32)
    return cfg, lr, b, w0, q32, k32, v32


def real_tokens(cfg: AttentionArgs, k: torch.Tensor) -> torch.Tensor:
    """(B, Nk) in k's dtype: 1 for a real key, 0 for a padded one."""
    if cfg.key_mask is None:
        return k.new_ones(k.shape[0], k.shape[2])
    return cfg.key_mask.to(k.dtype)


def _read(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Every query through its kv head's model: q (B, H, Nq, D) times W (B, Hkv, D, D)."""
    B, H, Nq, D = q.shape
    Hkv = w.shape[1]
    return (grouped_heads(q, Hkv) @ w.unsqueeze(2)).view(B, H, Nq, D)


def ttt_linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    inner_lr: float = 1.0,
    mini_batch_size: int | None = None,
    initial_weight: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The explicit inner loop: per-token gradients of 1/2 ||k W - v||^2 (by ``torch.func``), their mean over a
    mini-batch's real tokens, one step per mini-batch."""
    cfg, lr, b, w, q32, k32, v32 = _check(
        q, k, v, inner_lr, mini_batch_size, initial_weight, key_padding_mask, query_padding_mask, dropout_p
    )

    def loss(weight: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return 0.5 * (key @ weight - value).square().sum()

    per_token = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))  # over the tokens of a mini-batch
    per_head = torch.func.vmap(torch.func.vmap(per_token))  # over batch elements and kv heads
    real = real_tokens(cfg, k32)
    w = w.expand(k.shape[0], -1, -1, -1)
    for start in range(0, k.shape[2], b):
        grads = per_head(w, k32[:, :, start : start + b], v32[:, :, start : start + b])  # (B, Hkv, b, D, D)
        mask = real[:, None, start : start + b, None, None]
        n = mask.sum(2).clamp(min=1)  # a mini-batch of padded tokens only takes no step
        w = w - lr * (grads * mask).sum(2) / n
    return finish(_read(q32, w), cfg, q.dtype)


def ttt_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    inner_lr: float = 1.0,
    mini_batch_size: int | None = None,
    initial_weight: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Bidirectional TTT-Linear on (B, H, N, D) tensors in O(N D^2) (the dual form).

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        inner_lr (float): the inner learning rate, >= 0. Default: 1.0 (ViT^3's).
        mini_batch_size (int | None): keys per inner step; None takes all Nk (one full-batch step). Default: None.
        initial_weight (torch.Tensor | None): W_0, broadcastable to (Hkv, D, D); None is zero. Default: None.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): must be 0 (there are no attention probabilities to drop). Default: 0.0.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, lr, b, w, q32, k32, v32 = _check(
        q, k, v, inner_lr, mini_batch_size, initial_weight, key_padding_mask, query_padding_mask, dropout_p
    )
    real = real_tokens(cfg, k32)
    for start in range(0, k.shape[2], b):
        kt, vt = k32[:, :, start : start + b], v32[:, :, start : start + b]
        n = real[:, start : start + b].sum(1).clamp(min=1)[:, None, None, None]
        w = w - (lr / n) * (kt.transpose(-1, -2) @ (kt @ w - vt))  # padded tokens: zero rows of kt and vt
    return finish(_read(q32, w.expand(k.shape[0], -1, -1, -1)), cfg, q.dtype)


def ttt_flops(n: int, d: int, **_: object) -> float:
    """Per inner step K_t W and K_t^T E (2 b D^2 each, 4 N D^2 in all), and every query through W (2 N D^2)."""
    return 6 * n * d * d
