"""``AgentAttention``: timm's ``Attention`` with Agent attention (Han et al. 2024).

Options from the Agent attention paper: the agent bias (learned position biases
between the agents and the tokens of a fixed layout, added to both softmaxes) and a
depth-wise 3x3 convolution on V over the patch grid added to the output (kernel 3
over the sequence for 1-D inputs). Both add parameters: timm ``Attention`` state dicts
load with ``strict=False``, missing only those.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn

from ..ops.agent import agent_attention
from ..ops.checks import check_int
from .base import AttentionLayer, PatchGrid, check_bins, check_grid_option, conv_values, depthwise_conv, resolve_grid


def _bias(*shape: int, dd: dict) -> nn.Parameter:
    return nn.Parameter(nn.init.trunc_normal_(torch.empty(*shape, **dd), std=0.02))


class AgentBias(nn.Module):
    """Learned biases between n agents and the tokens of a fixed layout, for both softmaxes.

    On a (gh, gw) grid a bias is a row term plus a column term; on a 1-D sequence of L
    tokens there is one term per position. The prefix tokens have their own terms.
    ``forward(n_tokens)`` returns (aggregate (H, n, N), broadcast (H, N, n)).
    """

    def __init__(
        self, num_heads: int, num_agents: int, grid: tuple[int, int] | None, length: int, num_prefix_tokens: int, dd
    ) -> None:
        super().__init__()
        H, n, P = num_heads, num_agents, num_prefix_tokens
        self.grid, self.n_tokens = grid, P + (grid[0] * grid[1] if grid else length)
        self.agent_prefix, self.prefix_agent = _bias(H, n, P, dd=dd), _bias(H, P, n, dd=dd)
        if grid is None:
            self.agent_token, self.token_agent = _bias(H, n, length, dd=dd), _bias(H, length, n, dd=dd)
        else:
            (gh, gw) = grid
            self.agent_row, self.agent_col = _bias(H, n, gh, 1, dd=dd), _bias(H, n, 1, gw, dd=dd)
            self.row_agent, self.col_agent = _bias(H, gh, 1, n, dd=dd), _bias(H, 1, gw, n, dd=dd)

    def forward(self, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n_tokens != self.n_tokens:
            raise ValueError(f"the agent bias was built for N={self.n_tokens} tokens, got N={n_tokens}")
        if self.grid is None:
            aggregate, broadcast = self.agent_token, self.token_agent
        else:
            aggregate = (self.agent_row + self.agent_col).flatten(2)
            broadcast = (self.row_agent + self.col_agent).flatten(1, 2)
        return torch.cat([self.agent_prefix, aggregate], dim=2), torch.cat([self.prefix_agent, broadcast], dim=1)


class AgentAttention(AttentionLayer):
    """Multi-head self-attention with Agent attention; a drop-in for ``timm.models.vision_transformer.Attention``.

    Args (besides timm's):
        num_agents: n, or (nh, nw) / a perfect square with a 2-D grid.
        grid: None (1-D pooling), (gh, gw), (gt, gh, gw), or "auto" (a square grid of N - num_prefix_tokens).
        num_prefix_tokens: leading tokens (CLS) that are not pooled, biased or convolved (nor rotated by ``rope``).
        num_suffix_tokens: trailing tokens (ViT-5's registers) that are not pooled or convolved.
        agent_bias: learn the agent bias; needs the layout: ``grid=(gh, gw)``, or ``seq_len`` in 1-D.
        seq_len: N (prefix included) of a 1-D layout, for ``agent_bias``.
        dwc: add a depth-wise convolution of V (3x3 on the grid, 3 in 1-D) to the output.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args,
        num_agents: int | tuple[int, int] = 64,
        grid: tuple[int, int] | Literal["auto"] | None = None,
        num_prefix_tokens: int = 0,
        num_suffix_tokens: int = 0,
        agent_bias: bool = False,
        seq_len: int | None = None,
        dwc: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(
            dim, num_heads, *args, num_prefix_tokens=num_prefix_tokens, num_suffix_tokens=num_suffix_tokens, **kwargs
        )
        dd = self.dd
        self.grid = check_grid_option(grid)
        self.num_agents = check_bins("num_agents", num_agents, self.grid)
        if seq_len is not None:
            seq_len = check_int("seq_len", seq_len, self.num_prefix_tokens + 1)
        self.patch_grid: PatchGrid | None = None  # the running forward's patch grid (models of varying image size)
        self.agent_bias = None
        if agent_bias and self.num_suffix_tokens:
            raise ValueError("agent_bias has no terms for suffix tokens; use num_suffix_tokens=0 or agent_bias=False")
        if agent_bias:
            n = math.prod(self.num_agents) if isinstance(self.num_agents, tuple) else self.num_agents
            if isinstance(self.grid, tuple) and len(self.grid) == 3:
                raise ValueError("agent_bias is defined on 1-D and 2-D layouts; a 3-D grid takes agent_bias=False")
            if isinstance(self.grid, tuple):
                self.agent_bias = AgentBias(num_heads, n, self.grid, 0, self.num_prefix_tokens, dd)
            elif self.grid is None and seq_len is not None:
                length = seq_len - self.num_prefix_tokens
                self.agent_bias = AgentBias(num_heads, n, None, length, self.num_prefix_tokens, dd)
            else:
                raise ValueError(
                    "agent_bias needs a fixed token layout: grid=(gh, gw), or grid=None with seq_len=N "
                    f"(> num_prefix_tokens); got grid={grid!r}, seq_len={seq_len!r}"
                )
        self.dwc = depthwise_conv(self.attn_dim, self.grid, dd) if dwc else None

    def extra_repr(self) -> str:
        return (
            f"num_agents={self.num_agents}, grid={self.grid}, num_prefix_tokens={self.num_prefix_tokens}, "
            f"num_suffix_tokens={self.num_suffix_tokens}"
        )

    def resolve_grid(self, n: int) -> tuple[int, ...] | None:
        """The grid for a sequence of n tokens: the running forward's patch grid, or ``grid`` ("auto": a square)."""
        return resolve_grid(self.grid, n, self.num_prefix_tokens, self.patch_grid, self.num_suffix_tokens)

    def attend(self, q, k, v, key_padding_mask, is_causal):
        grid = self.resolve_grid(q.shape[2])
        if self.agent_bias is not None and self.agent_bias.grid is not None and grid != self.agent_bias.grid:
            raise ValueError(
                f"the agent bias was built for the grid {self.agent_bias.grid}, this input's grid is {grid}; "
                "run the layer on images of the size it was built for"
            )
        aggregate, broadcast = self.agent_bias(q.shape[2]) if self.agent_bias is not None else (None, None)
        out = agent_attention(
            q,
            k,
            v,
            num_agents=self.num_agents,
            grid=grid,
            num_prefix_tokens=self.num_prefix_tokens,
            num_suffix_tokens=self.num_suffix_tokens,
            key_padding_mask=key_padding_mask,
            query_padding_mask=key_padding_mask,
            dropout_p=self.dropout_p,
            aggregate_bias=aggregate,
            broadcast_bias=broadcast,
        )
        if self.dwc is not None:
            p, s = self.num_prefix_tokens, self.num_suffix_tokens
            out = out + conv_values(self.dwc, v, p, grid, key_padding_mask, s)
            if key_padding_mask is not None:
                out = out.masked_fill(~key_padding_mask[:, None, :, None], 0)
        return out
