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
