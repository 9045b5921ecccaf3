"""The recall study's experiment-only MiTA options (issue 31), on top of the library's layer.

The fix the study found is in the library: ``mita:landmark_pooling=distinct,merge_duplicates=True``
(:class:`~mita.layers.MiTAAttention`, :mod:`mita.ops.mita.landmarks`). What stays here is what
only the study uses, as the attention ``mita_recall`` within :func:`registered` (the recall task
builds its models there; the runs of ``docs/recall.md`` were trained under that name):

- ``rope=True``: rotary position embeddings on q and k before the call (spec section 2's
  order), which make identical tokens at different positions distinct.
- ``dense_steps=T`` (training only): the output is ``a * sdpa + (1 - a) * mita`` with ``a``
  falling linearly from 1 to 0 over the first T training forwards, a dense gradient path to
  every key that decays; evaluation (``model.eval()``) is pure MiTA at every step.

Every other option is :class:`~mita.layers.MiTAAttention`'s, so with ``rope`` and
``dense_steps`` off ``mita_recall`` is ``mita``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from mita.layers.mita import MiTAAttention
from mita.ops.checks import check_int
from mita.ops.mita import mita_attention, mita_flops
from mita.registry import REGISTRY, Method, Taxonomy, register

NAME = "mita_recall"


def rotary(x: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x (B, H, N, D) at positions 0 .. N-1; D even."""
    N, D = x.shape[-2], x.shape[-1]
    freq = base ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angle = torch.arange(N, device=x.device, dtype=torch.float32)[:, None] * freq
    cos, sin = angle.cos().repeat(1, 2).to(x.dtype), angle.sin().repeat(1, 2).to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RecallMiTAAttention(MiTAAttention):
    """:class:`~mita.layers.MiTAAttention` with the study's experiment-only options (module docstring).

    With ``record_routing`` the last call's q and k as attended (rotated by ``rope``) are kept in
    ``attended_qk`` for the diagnostics.

    Args:
        rope (bool): rotary position embeddings on q and k (1-D sequences only). Default: False.
        dense_steps (int): training forwards over which a dense (sdpa) share of the output
            falls from 1 to 0; 0 = off. Never used in evaluation. Default: 0.
        *args (Any): :class:`~mita.layers.MiTAAttention`'s positional arguments after ``num_heads``.
        **kwargs (Any): :class:`~mita.layers.MiTAAttention`'s keyword arguments
            (``landmark_pooling`` and ``merge_duplicates`` among them).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *args: Any,
        rope: bool = False,
        dense_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(dim, num_heads, *args, **kwargs)
        if not isinstance(rope, bool):
            raise TypeError(f"rope must be True or False, got {rope!r}")
        if rope and (self.grid is not None or self.compat is not None or self.num_prefix_tokens):
            raise ValueError(
                "rope=True rotates 1-D positions: leave grid, compat and num_prefix_tokens at their defaults"
            )
        if rope and self.head_dim % 2:
            raise ValueError(f"rope=True needs an even head dim, got {self.head_dim}")
        self.rope = rope
        self.dense_steps = check_int("dense_steps", dense_steps, 0)
        if self.dense_steps:  # the schedule's clock, saved with the weights (exact resume)
            self.register_buffer("dense_step", torch.zeros((), dtype=torch.long))
        self.attended_qk: tuple[torch.Tensor, torch.Tensor] | None = None  # q, k as attended (record_routing)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rope={self.rope}, dense_steps={self.dense_steps}"

    def dense_share(self) -> float:
        """The dense share a of the next forward: 1 - step / dense_steps in training, 0 in evaluation."""
        if not (self.training and self.dense_steps):
            return 0.0
        return max(0.0, 1.0 - float(self.dense_step) / self.dense_steps)

    def attend(self, q, k, v, key_padding_mask, is_causal):
        if self.rope:
            q, k = rotary(q), rotary(k)
        out = super().attend(q, k, v, key_padding_mask, is_causal)
        share = self.dense_share()
        if self.training and self.dense_steps:
            self.dense_step += 1
        if share > 0:
            mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
            out = share * F.scaled_dot_product_attention(q, k, v, attn_mask=mask) + (1 - share) * out
        if self.record_routing:
            self.attended_qk = (q.detach(), k.detach())
        return out


METHOD = Method(
    name=NAME,
    taxonomy=Taxonomy("compression + routing", "m", "MLP (softmax)", "content-dependent (landmark probing)", "N-to-m"),
    op=mita_attention,
    layer=RecallMiTAAttention,
    defaults={"num_landmarks": 64, "topk": 64},
    flops=mita_flops,  # the options add O(N log N) sorting only
    cost="N D (8m + 4sk)",
    paper="Wen et al. 2026 (arXiv 2602.01219), with the recall study's options (issue 31)",
)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """Within the block the registry knows ``mita_recall``; it is removed again after, so the
    library's registry (and whatever lists every method) is the same outside."""
    added = NAME not in REGISTRY
    if added:
        register(METHOD)
    try:
        yield
    finally:
        if added:
            REGISTRY.pop(NAME, None)
