"""The attention registry: names, config strings, the taxonomy and the FLOP model."""

from __future__ import annotations

import csv
import io

import pytest

from _zoo import IMPLEMENTED
from mita import attention as registry


@pytest.mark.parametrize("name", ["nope", "linformer", "deformable"])
def test_unknown_or_unimplemented_names_list_the_valid_ones(name):
    with pytest.raises(ValueError, match=f"{name}.*valid names: ") as err:
        registry.build_layer(name, 32, 4)
    assert all(n in str(err.value) for n in IMPLEMENTED)


def test_config_strings_take_tuples():
    assert registry.parse("agent:grid=(4, 4),num_agents=[2,2],dwc=True") == (
        "agent",
        {"grid": (4, 4), "num_agents": [2, 2], "dwc": True},
    )


def test_taxonomy_rows_have_five_filled_dimensions():
    rows = list(csv.DictReader(io.StringIO(registry.taxonomy_table("csv"))))
    assert [r["method"] for r in rows] == registry.names(implemented=False)
    assert {r["method"] for r in rows if r["implemented"] == "no"} >= {
        "linformer",
        "deformable",
        "swin",
        "performer",
    }
    assert {r["method"] for r in rows if r["implemented"] == "yes"} == set(IMPLEMENTED) >= {"ttt_linear", "ttt_mlp"}
    for row in rows:
        assert all(row[f].strip() for f in registry.Taxonomy.FIELDS), row
        assert row["cost per head (FLOPs)"].strip(), row
        assert row["paper"].strip(), row


def test_mita_taxonomy_row():
    row = next(r for r in csv.DictReader(io.StringIO(registry.taxonomy_table("csv"))) if r["method"] == "mita")
    assert [row[f] for f in registry.Taxonomy.FIELDS] == [
        "compression + routing",
        "m",
        "MLP (softmax)",
        "content-dependent (landmark probing)",
        "N-to-m",
    ]


@pytest.mark.parametrize("name", IMPLEMENTED)
def test_flops_follow_the_cost_model(name):
    n, d = 4096, 64
    dense = registry.flops("sdpa", n, d)
    cost = registry.flops(name, n, d)
    assert cost is not None and cost > 0
    if name not in ("sdpa", "topk"):  # sub-quadratic methods: well under dense attention at N = 4096
        assert cost < dense / 4
        assert registry.flops(name, 2 * n, d) < 2.5 * cost


def test_ttt_mlp_taxonomy_row():
    """TTT-MLP took the place of the not-implemented TTT row: an arbitrary learned model, cost O(N D h)."""
    row = next(r for r in csv.DictReader(io.StringIO(registry.taxonomy_table("csv"))) if r["method"] == "ttt_mlp")
    assert row["implemented"] == "yes"
    assert [row[f] for f in registry.Taxonomy.FIELDS] == [
        "compression",
        "1",
        "arbitrary (a learned model)",
        "content-dependent (test-time training)",
        "all-to-one",
    ]
    assert "ttt" not in registry.names(implemented=False)


def test_flops_closed_forms():
    assert registry.flops("mita", 1024, 64) == 1024 * 64 * (8 * 64 + 4 * 64)
    assert registry.flops("mita_shared:num_landmarks=16", 1024, 64) == 1024 * 64 * 8 * 16
    assert registry.flops("mita_routed:num_landmarks=16,topk=8", 1024, 64) == 1024 * 64 * (4 * 16 + 4 * 8)
    assert registry.flops("topk:topk=1024", 1024, 64) == registry.flops("sdpa", 1024, 64)
    assert registry.flops("linear", 1024, 64) == 4 * 1024 * 64 * 64 + 4 * 1024 * 64
    assert registry.flops("ttt_mlp", 1024, 64) == 14 * 1024 * 64 * (4 * 64)
    assert registry.flops("moba:block_size=64,topk=16", 1024, 64) == 2 * 1024 * 16 * 64 + 4 * 1024 * 1024 * 64


def test_layer_options_are_what_the_layers_take():
    """The options a layer binds: its constructor's, or its op's but for the tensors, masks and dropout."""
    options = {name: registry.layer_options(registry.get(name)) for name in IMPLEMENTED}
    assert options["sdpa"] == ["scale"]
    assert options["moba"] == ["block_size", "causal", "chunk_size", "scale", "topk"]
    assert options["nystrom"] == ["num_landmarks", "pinv_iterations", "scale"]
    mita = ["branches", "compat", "grid", "impl", "landmark_pooling", "merge_duplicates", "num_landmarks"]
    mita += ["num_prefix_tokens", "num_routed"]
    assert options["mita"] == options["mita_routed"] == [*mita, "num_suffix_tokens", "topk"]
    agent = ["agent_bias", "dwc", "grid", "num_agents", "num_prefix_tokens", "num_suffix_tokens", "seq_len"]
    assert options["agent"] == agent


def test_build_layer_takes_options_once():
    assert registry.build_layer("mita", 64, 4, topk=8).topk == 8  # over the method's default (64)
    with pytest.raises(ValueError, match=r"options \['topk'\] are given both in the config and as keyword"):
        registry.build_layer("mita:topk=4", 64, 4, topk=8)
