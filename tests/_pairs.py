"""Checks the op tests of issue 28 share: an efficient path against its reference on odd shapes (outputs
and gradients, GQA, masks, cross-attention), padding that takes no part, float64 gradcheck."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from _zoo import F64, padding, qkv
from mita import attention as registry
from test_ops_padding import FILLS

#: odd sequence lengths: one token, fewer than a block, a few blocks, a ViT's 197
LENGTHS = [1, 7, 50, 197]
#: (H, Hkv): grouped-query attention, and one kv head per query head
GROUPS = [(4, 2), (3, 3)]

Options = Callable[[int, int, int, int], dict]  # (H, Hkv, Nq, D) -> the op's options (tensors included)


def no_options(H: int, Hkv: int, Nq: int, D: int) -> dict:
    return {}


def _leaves(options: dict) -> list[torch.Tensor]:
    return [t for t in options.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def assert_paths_agree(
    fast: Callable,
    reference: Callable,
    options: Options,
    nq: int,
    nk: int,
    groups: tuple[int, int],
    masked: bool,
    rtol: float = 1e-10,
    atol: float = 1e-12,
) -> None:
    """Outputs and gradients (q, k, v and every tensor option that requires grad) of both paths, float64."""
    H, Hkv = groups
    q, k, v = (t.requires_grad_() for t in qkv(B=2, H=H, Hkv=Hkv, Nq=nq, Nk=nk, D=8))
    opts = options(H, Hkv, nq, 8)
    masks = {}
    if masked:
        masks["key_padding_mask"] = padding(2, nk, [nk, max(1, nk * 3 // 5)])
        if nq != nk:
            masks["query_padding_mask"] = padding(2, nq, [max(1, nq - 2), nq])
    out = fast(q, k, v, **masks, **opts)
    want = reference(q, k, v, **masks, **opts)
    assert out.shape == (2, H, nq, 8) and out.dtype == F64
    torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
    weight = torch.randn_like(out)
    leaves = [q, k, v, *_leaves(opts)]
    grads = torch.autograd.grad((weight * out).sum(), leaves)
    expected = torch.autograd.grad((weight * want).sum(), leaves)
    for got, wanted in zip(grads, expected):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, wanted, rtol=rtol * 10, atol=atol * 10)


def paths_agree_cases() -> list:
    """(nq, nk, groups, masked): self-attention at every length, GQA or not, masked or not; cross-attention."""
    cases = [
        pytest.param(n, n, g, m, id=f"N{n}-H{g[0]}kv{g[1]}-{'mask' if m else 'nomask'}")
        for n in LENGTHS
        for g in GROUPS
        for m in (False, True)
    ]
    return cases + [pytest.param(23, 41, (4, 2), m, id=f"cross-{'mask' if m else 'nomask'}") for m in (False, True)]


def padding_cases() -> list:
    """(tensor, fill, hkv, nq, nk) for ``test_ops_padding._check_padding_is_inert``: self- and cross-attention,
    GQA or not."""
    return [
        pytest.param(t, f, hkv, nq, nk, id=f"{t}-{f:g}-hkv{hkv}-{nq}x{nk}")
        for t in "qkv"
        for f in FILLS[:2]
        for hkv in (4, 2)
        for nq, nk in ((33, 33), (23, 41))
    ]


def assert_masked_equals_truncated(op: Callable, options: dict) -> None:
    """A sequence padded at the end gives the truncated sequence's output, and zeros after."""
    q, k, v = qkv(B=2, H=4, Hkv=2, Nq=33, Nk=33, D=8)
    out = op(q, k, v, key_padding_mask=padding(2, 33, [33, 26]), **options)
    alone = op(q[1:, :, :26], k[1:, :, :26], v[1:, :, :26], **options)
    torch.testing.assert_close(out[1, :, :26], alone[0])
    assert (out[1, :, 26:] == 0).all()
    torch.testing.assert_close(out[:1], op(q[:1], k[:1], v[:1], **options))


def assert_gradcheck(op: Callable, options: Options, groups: tuple[int, int] = (2, 1), n: int = 5, nk: int = 6) -> None:
    """``torch.autograd.gradcheck`` in float64 on a tiny masked cross-attention call."""
    H, Hkv = groups
    q, k, v = (t.requires_grad_() for t in qkv(B=2, H=H, Hkv=Hkv, Nq=n, Nk=nk, D=3))
    opts = options(H, Hkv, n, 3)
    names = [name for name, t in opts.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    mask = padding(2, nk, [nk, nk - 2])

    def call(q, k, v, *tensors):
        return op(q, k, v, key_padding_mask=mask, **{**opts, **dict(zip(names, tensors))})

    assert torch.autograd.gradcheck(call, (q, k, v, *(opts[name] for name in names)))


def assert_layer_extras(name: str, options: dict, extras: set[str]) -> None:
    """The layer adds exactly the modules ``extras`` to timm's ``Attention``: a timm state dict loads missing only
    them; ``mita.convert`` builds the layer into a ViT, and converts back to timm only without extras (it would
    drop them)."""
    import timm
    from timm.models.vision_transformer import Attention

    from mita import convert

    layer = registry.build_layer({"name": name, **options}, 32, 4, qkv_bias=True)
    result = layer.load_state_dict(Attention(32, 4, qkv_bias=True).state_dict(), strict=False)
    assert {key.split(".")[0] for key in result.missing_keys} == extras and not result.unexpected_keys
    vit = timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=5)
    convert(vit.eval(), name, **options)
    with torch.no_grad():
        assert torch.isfinite(vit(torch.randn(1, 3, 32, 32))).all()
    if not extras:
        convert(vit, "timm")
        return
    with pytest.raises(ValueError, match="would drop its modules"):
        convert(vit, "timm")
