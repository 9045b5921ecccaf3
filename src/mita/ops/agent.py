"""Agent attention (Han et al. 2024, "Agent Attention: On the Integration of Softmax and Linear Attention").

n agent tokens A are pooled from the queries. Agent aggregation gathers the context into
the agents, V_A = softmax(s A K^T + B1) V (n x D); agent broadcast hands it back,
out = softmax(s Q A^T + B2) V_A. It is one shared softmax expert of width n, built by
landmark probing (spec section 5). Both steps are linear in N; the reference forms the
equivalent (Nq, Nk) attention matrix softmax(s Q A^T) softmax(s A K^T) explicitly. The
agent bias (B1, B2) and the depth-wise convolution on V belong to the layer,
:class:`mita.layers.agent.AgentAttention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import checked_inputs, real_keys, softmax_allowed, zero_padded
from .pooling import check_pooling, pool, pool_reference


def _prepare(
    q,
    k,
    v,
    num_agents,
    grid,
    num_prefix_tokens,
    num_suffix_tokens,
    key_padding_mask,
    query_padding_mask,
    dropout_p,
    scale,
    agents,
    biases,
    pool_fn,
):
    """Checked arguments, the agents (given, or pooled by ``pool_fn``), and q, k, v with padded slots zero.

    Each bias must broadcast to its logits, (B, H, n, Nk) and (B, H, Nq, n). Padded slots are
    zeroed, not weighted by the mask (0 * NaN is NaN): a padded query would reach every agent
    through the pooling and the gradient of the broadcast, a padded key or value every agent
    through the aggregation.
    """
    cfg, q, k, v = checked_inputs(q, k, v, key_padding_mask, query_padding_mask, dropout_p, scale)
    B, H, Nq, D = q.shape
    if agents is None:
        pooling = check_pooling(
            num_agents, grid, num_prefix_tokens, Nq, num_suffix_tokens=num_suffix_tokens, name="num_agents"
        )
        agents = pool_fn(q, pooling, cfg.query_mask)
    elif (
        not isinstance(agents, torch.Tensor) or agents.dim() != 4 or agents.shape[:2] != (B, H) or agents.shape[3] != D
    ):
        got = tuple(agents.shape) if isinstance(agents, torch.Tensor) else type(agents).__name__
        raise ValueError(f"agents must be a tensor of shape (B={B}, H={H}, n, D={D}), got {got}")
    elif agents.dtype != q.dtype or agents.device != q.device or agents.shape[2] < 1:
        raise TypeError(f"agents must hold n >= 1 agents with q's dtype {q.dtype} and device {q.device}")
    n = agents.shape[2]
    shapes = {"aggregate_bias": (B, H, n, k.shape[2]), "broadcast_bias": (B, H, Nq, n)}
    for name, bias in zip(shapes, biases):
        if bias is None:
            continue
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"{name} must be a float tensor or None, got {type(bias).__name__}")
        try:
            torch.broadcast_shapes(bias.shape, shapes[name])
        except RuntimeError:
            raise ValueError(f"{name} of shape {tuple(bias.shape)} must broadcast to {shapes[name]}") from None
    return cfg, agents, q, k, v


def _kernels(q, k, agents, cfg, aggregate_bias, broadcast_bias, dropout_p):
    """The two softmax kernels: aggregation (B, H, n, Nk) and broadcast (B, H, Nq, n)."""
    B, H, _, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    logits = (agents.reshape(B, Hkv, -1, D) @ k.transpose(-1, -2)).view(B, H, agents.shape[2], Nk) * cfg.scale
    if aggregate_bias is not None:
        logits = logits + aggregate_bias
    aggregate = softmax_allowed(logits, real_keys(cfg))
    logits = cfg.scale * q @ agents.transpose(-1, -2)
    if broadcast_bias is not None:
        logits = logits + broadcast_bias
    broadcast = softmax_allowed(logits, None)
    if dropout_p > 0:
        aggregate, broadcast = F.dropout(aggregate, dropout_p), F.dropout(broadcast, dropout_p)
    return aggregate, broadcast


def agent_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_agents: int | tuple[int, int],
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    num_suffix_tokens: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    agents: torch.Tensor | None = None,
    aggregate_bias: torch.Tensor | None = None,
    broadcast_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Agent attention as one (Nq, Nk) attention matrix: broadcast kernel times aggregation kernel."""
    cfg, agents, q, k, v = _prepare(
        q,
        k,
        v,
        num_agents,
        grid,
        num_prefix_tokens,
        num_suffix_tokens,
        key_padding_mask,
        query_padding_mask,
        dropout_p,
        scale,
        agents,
        (aggregate_bias, broadcast_bias),
        pool_reference,
    )
    aggregate, broadcast = _kernels(q, k, agents, cfg, aggregate_bias, broadcast_bias, dropout_p)
    attn = broadcast @ aggregate  # (B, H, Nq, Nk), rows sum to 1
    return zero_padded(attn @ v.repeat_interleave(q.shape[1] // v.shape[1], dim=1), cfg)


def agent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_agents: int | tuple[int, int],
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0,
    num_suffix_tokens: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    agents: torch.Tensor | None = None,
    aggregate_bias: torch.Tensor | None = None,
    broadcast_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Agent attention on (B, H, N, D) tensors in O(N n D).

    Args:
        q (torch.Tensor): queries of shape (B, H, Nq, D).
        k (torch.Tensor): keys of shape (B, Hkv, Nk, D); H must be a multiple of Hkv (GQA).
        v (torch.Tensor): values of shape (B, Hkv, Nk, D).
        num_agents (int | tuple): n; with a grid, (nh, nw) / a perfect square, or (nt, nh, nw) / a perfect cube.
        grid (tuple | None): (gh, gw) or (gt, gh, gw) layout of the pooled tokens; None pools in 1-D. Default: None.
        num_prefix_tokens (int): leading tokens (CLS) that attend but are not pooled into agents. Default: 0.
        num_suffix_tokens (int): trailing tokens (registers) that attend but are not pooled. Default: 0.
        key_padding_mask (torch.Tensor | None): bool (B, Nk), True = real key. Default: None.
        query_padding_mask (torch.Tensor | None): bool (B, Nq), True = real query. Default: None, which
            in a call with Nq == Nk (self-attention) means the key mask.
        dropout_p (float): dropout on both softmax kernels. Default: 0.0.
        scale (float | None): logit scale, positive and finite. Default: D**-0.5.
        agents (torch.Tensor | None): (B, H, n, D) agent tokens to use instead of pooling. Default: None.
        aggregate_bias (torch.Tensor | None): added to the agent-to-key logits, broadcastable to
            (B, H, n, Nk). Default: None.
        broadcast_bias (torch.Tensor | None): added to the query-to-agent logits, broadcastable to
            (B, H, Nq, n). Default: None.

    Returns:
        The output of shape (B, H, Nq, D) and q's dtype; rows of padded queries are zero.
    """
    cfg, agents, q, k, v = _prepare(
        q,
        k,
        v,
        num_agents,
        grid,
        num_prefix_tokens,
        num_suffix_tokens,
        key_padding_mask,
        query_padding_mask,
        dropout_p,
        scale,
        agents,
        (aggregate_bias, broadcast_bias),
        pool,
    )
    aggregate, broadcast = _kernels(q, k, agents, cfg, aggregate_bias, broadcast_bias, dropout_p)
    B, H, _, D = q.shape
    agent_values = (aggregate.reshape(B, k.shape[1], -1, k.shape[2]) @ v).view(B, H, agents.shape[2], D)
    return zero_padded(broadcast @ agent_values, cfg)


def agent_flops(n: int, d: int, num_agents: int | tuple[int, int] = 64, **_: object) -> float:
    """Aggregation (A K^T, times V) and broadcast (Q A^T, times V_A): 2 n N D each."""
    a = num_agents if isinstance(num_agents, int) else num_agents[0] * num_agents[1]
    return 8 * n * a * d
