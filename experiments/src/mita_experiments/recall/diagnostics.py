"""Routing diagnostics of MiTA layers on a task whose target key is known (spec section 9).

Per layer and head, over the query positions (those with a target key):

- ``recall``: share of queries whose target key is among the keys of the experts they are
  routed to (the most the routed branch can retrieve);
- ``target_mass``: the softmax mass on the target key (its copies in two routed experts summed);
- ``landmark_mass``: the softmax mass on the landmarks (the shared expert; 0 without it);
- ``dup_share``: share of the experts' slots holding a key equal to an earlier slot's key of the
  same expert (identical tokens fill an expert with one key);
- ``lm_cosine``: mean pairwise cosine similarity of the landmarks (1: one vector);
- ``experts_used``: distinct experts that receive at least one real query of the sequence.

The last three are per sequence; as trainer metrics they are weighted by the sequence's query
count, like the others (:func:`diagnostic_scores`). :class:`RoutingProbe` captures what a MiTA
layer's forward decided (its q, k, mask and :class:`~mita.ops.mita.MiTARouting`) without
changing it; :func:`routing_metrics` computes the numbers from such a capture.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mita.layers.mita import MiTAAttention
from mita.ops.mita import MiTARouting
from mita.ops.mita.landmarks import DUP_TOL, key_offsets

METRICS = ("recall", "target_mass", "landmark_mass", "dup_share", "lm_cosine", "experts_used")


@dataclass
class Capture:
    """One MiTA call: q, k (B, H, N, D) as attended, the real keys (B, N) or None, its routing,
    the logit added to each expert slot (B, H, m, k) or None, its scales and branches."""

    q: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor | None
    routing: MiTARouting
    bonus: torch.Tensor | None
    scale: float
    landmark_scale: float
    branches: str


def metric_names(depth: int, num_heads: int) -> tuple[str, ...]:
    """Column names of the diagnostics of ``depth`` MiTA layers of ``num_heads`` heads: ``{metric}_l{l}h{h}``."""
    return tuple(f"{name}_l{layer}h{head}" for name in METRICS for layer in range(depth) for head in range(num_heads))


def target_keys(key_ids: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The position of each query's target key: the first position holding the query's key id.

    In both recall forms the pair comes before its queries, so this is the pair's key.

    Args:
        key_ids: (B, N) integer ids of the key channel (one-hop: channel 0; interleaved: the tokens).
        query: (B, N) bool, True at the query positions.

    Returns:
        (B, N) long: the target position at query positions, -1 elsewhere.
    """
    if key_ids.shape != query.shape or key_ids.dim() != 2:
        raise ValueError(f"key_ids and query must both be (B, N), got {tuple(key_ids.shape)} and {tuple(query.shape)}")
    ids = key_ids.long()
    B, N = ids.shape
    pos = torch.arange(N, device=ids.device).expand(B, N)
    first = torch.full((B, int(ids.max()) + 1), N, dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(1, ids, pos, reduce="amin")
    return torch.where(query, first.gather(1, ids), -1)


def _same_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., k, k) bool: rows i, j of x (..., k, D) equal within :data:`DUP_TOL` (relative)."""
    dist = torch.cdist(x.float(), x.float())
    norm = x.float().norm(dim=-1)
    return dist <= DUP_TOL * torch.maximum(norm[..., :, None], norm[..., None, :]).clamp_min(1e-12)


@torch.no_grad()
def routing_metrics(cap: Capture, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The diagnostics of one capture.

    Args:
        cap: a MiTA call (:class:`Capture`).
        targets: (B, N) long, each query's target key position, -1 where there is none.

    Returns:
        ``{metric: (B, H) sums over the query positions of each sequence}`` for the per-query
        metrics and ``{metric: (B, H) per-sequence value}`` for dup_share, lm_cosine and
        experts_used, plus ``"count"`` (B,), the query positions of each sequence.
    """
    q, k = cap.q.float(), cap.k.float()
    landmarks, experts, routes = cap.routing
    B, H, N, D = q.shape
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    if targets.shape != (B, N):
        raise ValueError(f"targets must be (B, N) = {(B, N)}, got {tuple(targets.shape)}")
    m, kk, s = experts.shape[-2], experts.shape[-1], routes.shape[-1]
    real = torch.ones(B, N, dtype=torch.bool, device=q.device) if cap.mask is None else cap.mask
    has = targets >= 0
    out: dict[str, torch.Tensor] = {"count": has.sum(1).float()}

    # Per query: the routed experts' slots (B, H, N, s*k), their logits, and the softmax with the landmarks.
    idx = experts.gather(2, routes.reshape(B, H, N * s, 1).expand(-1, -1, -1, kk)).reshape(B, H, N, s * kk)
    keys = k.gather(2, idx.reshape(B, H, -1, 1).expand(-1, -1, -1, D)).reshape(B, H, N, s * kk, D)
    routed = cap.scale * (keys @ q.unsqueeze(-1)).squeeze(-1)
    slot_real = real[:, None, None, :].expand(B, H, N, N).gather(3, idx)
    if cap.bonus is not None:  # a slot whose offset is -inf holds no key
        offset = cap.bonus.gather(2, routes.reshape(B, H, N * s, 1).expand(-1, -1, -1, kk)).reshape(B, H, N, s * kk)
        routed, slot_real = routed + offset, slot_real & (offset > float("-inf"))
    routed = routed.masked_fill(~slot_real, float("-inf"))
    gate = cap.landmark_scale * q @ landmarks.float().transpose(-1, -2)
    parts = ([gate] if cap.branches != "routed" else []) + ([routed] if cap.branches != "shared" else [])
    p = torch.softmax(torch.cat(parts, -1), -1)
    n_lm = m if cap.branches != "routed" else 0
    hit = (idx == targets[:, None, :, None].clamp_min(0)) & slot_real & has[:, None, :, None]
    p_routed = p[..., n_lm:] if cap.branches != "shared" else torch.zeros_like(routed)
    w = has[:, None, :].float()
    out["recall"] = (hit.any(-1).float() * w).sum(-1)
    out["target_mass"] = ((p_routed * hit).sum(-1) * w).sum(-1)
    out["landmark_mass"] = (p[..., :n_lm].sum(-1) * w).sum(-1)

    # Per sequence: duplicate slots, landmark similarity, experts used.
    ek = k.gather(2, experts.reshape(B, H, m * kk, 1).expand(-1, -1, -1, D)).reshape(B, H, m, kk, D)
    earlier = torch.ones(kk, kk, dtype=torch.bool, device=q.device).tril(-1)
    out["dup_share"] = (_same_rows(ek) & earlier).any(-1).float().mean((-1, -2))
    unit = torch.nn.functional.normalize(landmarks.float(), dim=-1)
    cos = unit @ unit.transpose(-1, -2)
    out["lm_cosine"] = (cos.sum((-1, -2)) - cos.diagonal(dim1=-2, dim2=-1).sum(-1)) / max(m * (m - 1), 1)
    sink = torch.where(real[:, None, :, None], routes, m).reshape(B, H, -1)  # padded queries: slot m
    used = torch.zeros(B, H, m + 1, device=q.device).scatter(2, sink, 1.0)[..., :m]
    out["experts_used"] = used.sum(-1)
    return out


def mita_layers(model: torch.nn.Module) -> list[MiTAAttention]:
    """The MiTA layers of ``model``, in module order (their call order in a plain stack)."""
    return [mod for mod in model.modules() if isinstance(mod, MiTAAttention)]


def model_metric_names(model: torch.nn.Module) -> tuple[str, ...]:
    """:func:`metric_names` of a model's MiTA layers (one call each per forward)."""
    layers = mita_layers(model)
    return metric_names(len(layers), layers[0].num_heads) if layers else ()


class RoutingProbe(contextlib.AbstractContextManager):
    """Within ``with RoutingProbe(model) as probe:`` every MiTA layer of ``model`` records its calls
    in ``probe.captures`` (one :class:`Capture` per layer call, in call order). The layers' outputs
    are unchanged; on exit they are restored as they were."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = mita_layers(model)
        if not self.layers:
            raise ValueError("the model has no MiTA layer (mita.layers.MiTAAttention) to probe")
        self.captures: list[Capture] = []
        self._saved: list[tuple[MiTAAttention, bool]] = []

    def __enter__(self) -> RoutingProbe:
        for layer in self.layers:
            self._saved.append((layer, layer.record_routing))
            layer.record_routing = True
            layer.attend = self._wrap(layer)  # an instance attribute over the class's method
        return self

    def __exit__(self, *exc: object) -> None:
        for layer, record in self._saved:
            del layer.attend
            layer.record_routing = record
        self._saved.clear()

    @staticmethod
    def _bonus(
        layer: MiTAAttention, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Each expert slot's logit offset (B, H, m, k) of a layer with ``merge_duplicates``, else None."""
        if not layer.merge_duplicates:
            return None
        experts = layer.routing.experts
        offset = key_offsets(k, v, mask).repeat_interleave(experts.shape[1] // k.shape[1], dim=1)
        return offset.float().gather(2, experts.flatten(2)).view(experts.shape)

    def _wrap(self, layer: MiTAAttention):
        attend = type(layer).attend.__get__(layer)

        def wrapped(q, k, v, key_padding_mask, is_causal):
            out = attend(q, k, v, key_padding_mask, is_causal)
            s0 = layer.head_dim**-0.5
            q_att, k_att = (t.detach() for t in getattr(layer, "attended_qk", (q, k)))
            self.captures.append(
                Capture(
                    q=q_att,
                    k=k_att,
                    mask=key_padding_mask,
                    routing=layer.routing,
                    bonus=self._bonus(layer, k_att, v.detach(), key_padding_mask),
                    scale=s0,
                    landmark_scale=layer.head_dim**-1.0 if layer.compat == "official" else s0,
                    branches=layer.branches,
                )
            )
            return out

        return wrapped


def diagnostic_scores(captures: list[Capture], targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The diagnostics of a forward's captures as trainer metric sums (``{metric}_l{l}h{h}``): each
    summed over the query positions (per-sequence values weighted by the sequence's query count),
    so that the trainer's division by the number of targets gives the mean per query."""
    sums: dict[str, torch.Tensor] = {}
    for layer, cap in enumerate(captures):
        res = routing_metrics(cap, targets)
        count = res.pop("count")
        for name, value in res.items():
            per_query = name in ("recall", "target_mass", "landmark_mass")
            total = value.sum(0) if per_query else (value * count[:, None]).sum(0)
            for head in range(total.shape[0]):
                sums[f"{name}_l{layer}h{head}"] = total[head]
    return sums
