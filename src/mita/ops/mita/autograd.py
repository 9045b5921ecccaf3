"""Hand-written backward passes for the two softmax partials of the grouped MiTA path.

Both return a softmax result and its log-sum-exp, and both are differentiated with
respect to the two: d logits = p * (dp - <p, dp> + d_lse). Writing them by hand keeps
autograd from saving the score and probability tensors (the tiles recompute them) and
from differentiating the max-based log-sum-exp through comparison masks.
"""

from __future__ import annotations

import torch


def _lse(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """log-sum-exp from the softmax: max(logits) - log(max(p)), two cheap passes."""
    return logits.amax(-1) - torch.log(p.amax(-1))


class SoftmaxLSE(torch.autograd.Function):
    """(softmax(x), logsumexp(x)) over the last dim, computed in ``acc`` precision."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.to(acc)
        p = torch.softmax(logits, -1)
        ctx.save_for_backward(p)
        return p, _lse(logits, p)

    @staticmethod
    def backward(ctx, dp: torch.Tensor | None, dlse: torch.Tensor | None):
        (p,) = ctx.saved_tensors
        dx = torch.zeros_like(p) if dp is None else torch._softmax_backward_data(dp.to(p.dtype), p, -1, p.dtype)
        if dlse is not None:
            dx = torch.addcmul(dx, p, dlse.to(p.dtype).unsqueeze(-1))
        return dx, None


class TileAttention(torch.autograd.Function):
    """Softmax attention of each tile of T query rows over its expert's keys.

    q (tiles, T, D), k and v (tiles, kk, D), ``real`` (tiles, kk) bool or None, ``bias`` (tiles, kk)
    a constant added to the scaled scores (merged duplicates' log(copies)) or None. Returns
    the output (tiles, T, D) and the log-sum-exp of the scaled scores (tiles, T). The
    backward recomputes the scores instead of saving them.
    """

    @staticmethod
    def forward(ctx, q, k, v, real, bias, scale: float, dropout_p: float, acc: torch.dtype):
        scores = TileAttention._scores(q, k, real, bias, scale, acc)
        p = torch.softmax(scores, -1)
        lse = _lse(scores, p)
        keep = None
        if dropout_p > 0:
            keep = torch.rand_like(p) >= dropout_p
            p = p * keep / (1 - dropout_p)
        out = torch.bmm(p.to(v.dtype), v)
        ctx.save_for_backward(q, k, v, real, bias, out, lse, keep)
        ctx.scale, ctx.dropout_p, ctx.acc = scale, dropout_p, acc
        return out, lse

    @staticmethod
    def _scores(q, k, real, bias, scale, acc):
        s = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0, alpha=scale).to(acc)
        if bias is not None:
            s = s + bias.unsqueeze(1)
        return s if real is None else s.masked_fill(~real.unsqueeze(1), float("-inf"))

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, real, bias, out, lse, keep = ctx.saved_tensors
        # A probability is at most 1: the clamp keeps it so where rounding puts a score above the lse
        # (by up to half an ulp of it, which overflows exp once the logits pass 2**31 in float32).
        p = torch.exp((TileAttention._scores(q, k, real, bias, ctx.scale, ctx.acc) - lse.unsqueeze(-1)).clamp(max=0))
        dout = torch.zeros_like(out) if dout is None else dout
        dp = torch.bmm(dout, v.transpose(1, 2)).to(p.dtype)  # gradient w.r.t. the (dropped) probabilities
        p_used = p if keep is None else p * keep / (1 - ctx.dropout_p)
        dv = torch.bmm(p_used.to(v.dtype).transpose(1, 2), dout)
        if keep is not None:
            dp = dp * keep / (1 - ctx.dropout_p)
        # d scores = p * (dp - <p, dp> + dlse); <p, dp> = <out, dout> row-wise
        delta = (out * dout).sum(-1, dtype=p.dtype)
        if dlse is not None:
            delta = delta - dlse.to(p.dtype)
        ds = (p * (dp - delta.unsqueeze(-1))).to(q.dtype)
        dq = torch.baddbmm(q.new_empty(()), ds, k, beta=0, alpha=ctx.scale)
        dk = torch.baddbmm(k.new_empty(()), ds.transpose(1, 2), q, beta=0, alpha=ctx.scale)
        return dq, dk, dv, None, None, None, None, None
