"""The zoo's layers: every registered method as a timm-compatible layer, Agent attention's options."""

from __future__ import annotations

import pytest
import torch

from _zoo import CAUSAL, IMPLEMENTED, _small, padding
from mita import attention as registry
from mita.layers.agent import AgentAttention


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_every_method_builds_by_name_and_trains(name, device):
    layer = registry.build_layer(name, 32, 4).to(device)
    assert isinstance(layer, registry.AttentionLayer)
    x = torch.randn(2, 17, 32, device=device, requires_grad=True)
    mask = padding(2, 17, [17, 12], device)
    out = layer(x, attn_mask=mask)
    assert out.shape == x.shape
    out.square().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    assert (out[1, 12:] == layer.proj.bias).all()  # padded rows: zero attention output, then proj


def test_agent_layer_options_change_the_output():
    """The bias and the convolution are used: zeroing them gives the plain layer's output."""
    layer = AgentAttention(32, 4, agent_bias=True, dwc=True, grid=(4, 4), num_prefix_tokens=1, num_agents=4)
    plain = AgentAttention(32, 4, grid=(4, 4), num_prefix_tokens=1, num_agents=4)
    plain.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(2, 17, 32)
    assert not torch.allclose(layer(x), plain(x))
    with torch.no_grad():
        for p in layer.agent_bias.parameters():
            p.zero_()
        layer.dwc.weight.zero_()
        layer.dwc.bias.zero_()
    torch.testing.assert_close(layer(x), plain(x))


def test_agent_bias_is_row_plus_column():
    layer = AgentAttention(16, 2, agent_bias=True, grid=(2, 3), num_agents=4)
    bias = layer.agent_bias
    aggregate, broadcast = bias(6)
    assert aggregate.shape == (2, 4, 6) and broadcast.shape == (2, 6, 4)
    torch.testing.assert_close(aggregate[1, 3, 1 * 3 + 2], bias.agent_row[1, 3, 1, 0] + bias.agent_col[1, 3, 0, 2])
    torch.testing.assert_close(broadcast[0, 1 * 3 + 0, 2], bias.row_agent[0, 1, 0, 2] + bias.col_agent[0, 0, 0, 2])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"grid": 5}, "grid"),
        ({"agent_bias": True}, "agent_bias needs a fixed token layout"),
        ({"agent_bias": True, "grid": "auto"}, "agent_bias needs a fixed token layout"),
        ({"num_prefix_tokens": -1}, "num_prefix_tokens"),
    ],
    ids=["grid", "bias-no-layout", "bias-auto-grid", "prefix"],
)
def test_agent_layer_errors(options, match):
    with pytest.raises(ValueError, match=match):
        AgentAttention(32, 4, **options)


def test_agent_bias_rejects_another_length():
    layer = AgentAttention(32, 4, agent_bias=True, seq_len=10, num_agents=4)
    with pytest.raises(ValueError, match="built for N=10 tokens, got N=12"):
        layer(torch.randn(1, 12, 32))


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_layers_run_causally_when_their_op_can(name):
    layer = registry.build_layer({"name": name, **_small(name)}, 32, 4)
    x = torch.randn(1, 12, 32)
    if name not in CAUSAL:
        with pytest.raises(NotImplementedError, match="causal"):
            layer(x, is_causal=True)
        return
    out = layer(x, is_causal=True)
    x2 = x.clone()
    x2[:, 8:] = torch.randn(1, 4, 32)
    torch.testing.assert_close(layer(x2, is_causal=True)[:, :8], out[:, :8])
    assert not torch.allclose(layer(x), out)


def test_layers_with_a_3d_grid_convolve_in_3d():
    """Video layouts: pooling and the depth-wise convolution of V over (gt, gh, gw); no agent bias in 3-D."""
    from mita.layers import MiTAVisionAttention

    x = torch.randn(2, 1 + 2 * 3 * 3, 16)
    agent = AgentAttention(16, 2, num_agents=(1, 1, 2), grid=(2, 3, 3), num_prefix_tokens=1, dwc=True)
    vision = MiTAVisionAttention(16, 2, num_landmarks=(1, 1, 2), topk=3, grid=(2, 3, 3), num_prefix_tokens=1, dwc=True)
    for layer in (agent, vision):
        assert isinstance(layer.dwc, torch.nn.Conv3d)
        assert layer(x).shape == x.shape
    with pytest.raises(ValueError, match="agent_bias is defined on 1-D and 2-D layouts"):
        AgentAttention(16, 2, grid=(2, 3, 3), agent_bias=True)


#: a bad option of each registered method's layer, and the words its ValueError/TypeError must hold
BAD_OPTIONS = {
    "sdpa": [({"scale": -1.0}, "scale must be positive"), ({"dropout_p": 0.1}, r"no options \['dropout_p'\]")],
    "mita": [
        ({"num_landmarks": 0}, "num_landmarks must be an int >= 1"),
        ({"topk": 0}, "topk must be an int >= 1"),
        ({"num_routed": 0}, "num_routed must be an int >= 1"),
        ({"num_landmarks": 4, "num_routed": 5}, r"num_routed must be an int in \[1, num_landmarks=4\]"),
        ({"grid": "auto", "num_landmarks": 5}, "num_landmarks=5 with a 2-D grid must be a perfect square"),
        ({"grid": (2, 3, 4), "num_landmarks": (2, 2)}, r"num_landmarks with a 3-D grid must be a perfect cube"),
        ({"grid": (0, 4)}, "grid must be None, 'auto', .* of ints >= 1"),
        ({"num_prefix_tokens": -1}, "num_prefix_tokens must be an int >= 0"),
        ({"landmarks": None}, r"no options \['landmarks'\]"),
    ],
    "mita_routed": [({"topk": 1.5}, "topk must be an int >= 1")],
    "mita_shared": [({"num_landmarks": (2, 2)}, "num_landmarks must be an int >= 1")],
    "topk": [({"topk": 0}, "topk must be an int >= 1"), ({"chunk_size": 0}, "chunk_size must be an int >= 1")],
    "moba": [({"block_size": 0}, "block_size must be an int >= 1"), ({"topk": -2}, "topk must be an int >= 1")],
    "linear": [({"causal": "yes"}, "causal must be True or False"), ({"key_padding_mask": None}, "no options")],
    "agent": [
        ({"num_agents": 0}, "num_agents must be an int >= 1"),
        ({"grid": (4, 4), "num_agents": 6}, "num_agents=6 with a 2-D grid must be a perfect square"),
        ({"agent_bias": True, "seq_len": 0}, "seq_len must be an int >= 1"),
        ({"num_prefix_tokens": 1.0}, "num_prefix_tokens must be an int >= 0"),
    ],
    "nystrom": [
        ({"num_landmarks": 0}, "num_landmarks must be an int >= 1"),
        ({"pinv_iterations": 0}, "pinv_iterations must be an int >= 1"),
    ],
    "flatten": [
        ({"focusing_factor": 0.0}, "focusing_factor must be positive"),
        ({"dwc": True, "kernel_size": 4}, "kernel_size must be an odd int"),
    ],
    "inline": [({"grid": (0, 4)}, "grid must be None, 'auto', .* of ints >= 1")],
    "pola": [({"alpha": -1.0}, "alpha must be positive")],
    "mhla": [
        ({"num_blocks": 0}, "num_blocks must be an int >= 1"),
        ({"grid": "auto", "num_blocks": 5}, "num_blocks=5 with a 2-D grid must be a perfect square"),
    ],
    "ttt_linear": [
        ({"inner_lr": -1.0}, "inner_lr must be a finite float >= 0"),
        ({"mini_batch_size": 0}, "mini_batch_size must be an int >= 1"),
    ],
    "ttt_mlp": [
        ({"inner_lr": float("nan")}, "inner_lr must be a finite float >= 0"),
        ({"inner_lr": -1.0}, "inner_lr must be a finite float >= 0"),
        ({"mini_batch_size": 2.5}, "mini_batch_size must be an int >= 1"),
        ({"mini_batch_size": 0}, "mini_batch_size must be an int >= 1"),
    ],
    "nsa": [({"window": -1}, "window must be an int >= 0"), ({"topk": 0}, "topk must be an int >= 1")],
}
#: timm's arguments, checked by every layer
BAD_LAYER_ARGS = [
    ({"attn_drop": 1.0}, r"attn_drop must be a float in \[0, 1\)"),
    ({"proj_drop": -0.1}, r"proj_drop must be a float in \[0, 1\)"),
    ({"dim_out": 0}, "dim_out must be an int >= 1"),
]


@pytest.mark.parametrize(
    ("name", "options", "match"), [(name, o, m) for name in IMPLEMENTED for o, m in BAD_OPTIONS[name]]
)
def test_layers_check_their_options_at_construction(name, options, match):
    """No forward needed: every bad option is refused by the constructor, naming it."""
    assert set(BAD_OPTIONS) == set(IMPLEMENTED)
    with pytest.raises((ValueError, TypeError), match=match):
        registry.build_layer({"name": name, **options}, dim=64, num_heads=4)


@pytest.mark.parametrize("name", IMPLEMENTED)
@pytest.mark.parametrize(("args", "match"), BAD_LAYER_ARGS, ids=["attn_drop", "proj_drop", "dim_out"])
def test_layers_check_timm_arguments_at_construction(name, args, match):
    with pytest.raises(ValueError, match=match):
        registry.build_layer(name, dim=64, num_heads=4, **args)


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_unknown_options_list_the_accepted_ones(name):
    with pytest.raises(ValueError, match=rf"attention '{name}' takes no options \['bogus'\]; its options: ") as err:
        registry.build_layer(f"{name}:bogus=1", 64, 4)
    assert str(err.value).endswith(str(registry.layer_options(registry.get(name))))
    with pytest.raises(ValueError, match=r"takes no keyword arguments \['bogus'\]; it takes the method's options"):
        registry.build_layer(name, 64, 4, bogus=1)


def test_patch_grid_is_per_thread_and_not_copied():
    import copy
    import threading

    from mita.layers.base import PatchGrid

    grid = PatchGrid()
    grid.current = (16, 9)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(grid.current))
    thread.start()
    thread.join()
    assert seen == [None] and grid.current == (16, 9)
    assert copy.deepcopy(grid).current is None
