"""Routing diagnostics (recall/diagnostics.py) on hand-built routings whose values are known, and
the study's experiment-only MiTA options (recall/routing.py) against the library's layer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mita.layers.mita import MiTAAttention
from mita.ops.mita import MiTARouting, mita_attention
from mita.ops.mita.landmarks import duplicate_groups, key_offsets
from mita_experiments.recall import diagnostics as diag
from mita_experiments.recall import routing, task


def test_target_keys_first_occurrence():
    # one-hop key channel: pairs 5, 7, 9 at 0..2, filler 1, queries 9 at 4 and 5 at 6
    ids = torch.tensor([[5, 7, 9, 1, 9, 1, 5]])
    query = torch.tensor([[False, False, False, False, True, False, True]])
    assert diag.target_keys(ids, query).tolist() == [[-1, -1, -1, -1, 2, -1, 0]]
    # interleaved: k v k v, then a query of the second key
    ids = torch.tensor([[3, 10, 4, 11, 1, 4]])
    query = torch.tensor([[False] * 5 + [True]])
    assert diag.target_keys(ids, query).tolist() == [[-1] * 5 + [2]]
    with pytest.raises(ValueError, match=r"\(B, N\)"):
        diag.target_keys(ids[0], query[0])


def _capture(q, k, landmarks, experts, routes, branches="both", bonus=None, mask=None):
    return diag.Capture(q, k, mask, MiTARouting(landmarks, experts, routes), bonus, 1.0, 1.0, branches)


def test_routing_metrics_hand_built():
    # N = 4 tokens, D = 2, m = 2 experts of k = 2 keys; keys 1 and 2 are the same vector.
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]])[None, None]
    q = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0], [0.0, 0.0]])[None, None]
    landmarks = torch.tensor([[1.0, 0.0], [0.0, 1.0]])[None, None]  # orthogonal: cosine 0
    experts = torch.tensor([[0, 3], [1, 2]])[None, None]  # expert 1 holds one key twice
    routes = torch.tensor([[0], [0], [1], [1]])[None, None]
    targets = torch.tensor([[0, -1, 3, -1]])  # query 0 wants key 0 (routed to it), query 2 key 3 (not)
    res = diag.routing_metrics(_capture(q, k, landmarks, experts, routes), targets)
    assert res["count"].tolist() == [2.0]
    assert res["recall"].item() == pytest.approx(1.0)  # one of the two queries
    # query 0: logits [q.l0, q.l1 ; q.k0, q.k3] = [1, 0 ; 1, 1]
    p0 = torch.softmax(torch.tensor([1.0, 0.0, 1.0, 1.0]), 0)
    # query 2: logits [0, 2 ; 2, 2] (keys 1, 2), target 3 not there
    p2 = torch.softmax(torch.tensor([0.0, 2.0, 2.0, 2.0]), 0)
    assert res["target_mass"].item() == pytest.approx(p0[2].item(), abs=1e-6)
    assert res["landmark_mass"].item() == pytest.approx((p0[:2].sum() + p2[:2].sum()).item(), abs=1e-6)
    assert res["dup_share"].item() == pytest.approx(0.25)  # one duplicate slot of four
    assert res["lm_cosine"].item() == pytest.approx(0.0, abs=1e-6)
    assert res["experts_used"].item() == 2.0
    # routed-only: no landmark mass; a logit offset on slot 1 of expert 0 moves the target's mass
    bonus = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])[None, None]
    res = diag.routing_metrics(_capture(q, k, landmarks, experts, routes, "routed", bonus), targets)
    assert res["landmark_mass"].item() == 0.0
    assert res["target_mass"].item() == pytest.approx(0.25, abs=1e-6)  # e^1 / (e^1 + 3 e^1)


def test_routing_metrics_one_vector_and_padding():
    k = torch.randn(1, 1, 5, 4)
    q = torch.randn(1, 1, 5, 4)
    landmarks = torch.ones(1, 1, 3, 4)  # three copies of one vector: cosine 1
    experts = torch.tensor([[0, 0], [0, 0], [4, 4]])[None, None]  # key 4 is padding
    routes = torch.tensor([[0], [0], [1], [1], [2]])[None, None]  # the padded query (4) uses expert 2
    mask = torch.tensor([[True, True, True, True, False]])
    targets = torch.tensor([[-1, 0, -1, 4, -1]])
    res = diag.routing_metrics(_capture(q, k, landmarks, experts, routes, mask=mask), targets)
    assert res["lm_cosine"].item() == pytest.approx(1.0)
    assert res["experts_used"].item() == 2.0  # the padded query's expert does not count
    assert res["dup_share"].item() == pytest.approx(0.5)  # every expert: one key twice
    assert res["recall"].item() == 1.0  # query 1 finds key 0; a padded key (4) is never found


def test_target_mass_matches_the_operator():
    """With one-hot values the routed-only operator's output at the target is the target's mass."""
    torch.manual_seed(0)
    N = 16
    q, k = torch.randn(2, 2, N, N), torch.randn(2, 2, N, N)
    v = torch.eye(N).expand(2, 2, N, N)
    out, r = mita_attention(
        q, k, v, num_landmarks=4, topk=5, num_routed=2, branches="routed", impl="reference", return_routing=True
    )
    targets = torch.randint(0, N, (2, N))
    targets[:, ::3] = -1
    cap = diag.Capture(q, k, None, r, None, N**-0.5, N**-0.5, "routed")
    res = diag.routing_metrics(cap, targets)
    has = targets >= 0
    want = (out.gather(3, targets.clamp_min(0)[:, None, :, None].expand(2, 2, N, 1))[..., 0] * has[:, None]).sum(-1)
    torch.testing.assert_close(res["target_mass"], want)
    found = (out.gather(3, targets.clamp_min(0)[:, None, :, None].expand(2, 2, N, 1))[..., 0] > 0) & has[:, None]
    torch.testing.assert_close(res["recall"], found.float().sum(-1))


def test_target_mass_matches_the_merged_operator():
    """Merged duplicates: with values one-hot per group of equal (key, value) pairs, the routed-only
    operator's output at the target's group is the target's mass (all its copies)."""
    torch.manual_seed(0)
    N, G = 24, 8
    group = torch.randint(0, G, (2, 1, N)).expand(2, 2, N)
    q = torch.randn(2, 2, N, G)
    k = torch.randn(2, 2, G, G).gather(2, group[..., None].expand(-1, -1, -1, G))
    v = torch.eye(G)[group]
    out, r = mita_attention(
        q,
        k,
        v,
        num_landmarks=3,
        topk=4,
        branches="routed",
        merge_duplicates=True,
        impl="reference",
        return_routing=True,
    )
    experts = r.experts
    bonus = key_offsets(k, v).gather(2, experts.flatten(2)).view(experts.shape)
    first = torch.stack(
        [torch.stack([(group[b, 0] == group[b, 0, j]).nonzero()[0, 0] for j in range(N)]) for b in (0, 1)]
    )
    targets = first.clone()
    targets[:, ::3] = -1
    res = diag.routing_metrics(diag.Capture(q, k, None, r, bonus, G**-0.5, G**-0.5, "routed"), targets)
    has = targets >= 0
    at_target = out.gather(3, group[:, :1].gather(2, targets.clamp_min(0)[:, None])[..., None].expand(2, 2, N, 1))
    torch.testing.assert_close(res["target_mass"], (at_target[..., 0] * has[:, None]).sum(-1))


def _model(attention, depth=2):
    cfg = task.config(overrides=["data.seq_len=32", "data.num_pairs=4", "data.vocab_size=16", "data.diagnostics=True"])
    cfg["model"]["depth"] = depth
    torch.manual_seed(0)
    meta = {"num_classes": 8, "dual": False, "vocab_size": 17, "max_length": 32}
    return cfg, task.build_model(cfg, meta, attention).eval()


def test_probe_leaves_the_model_unchanged():
    _, model = _model("mita:num_landmarks=4,topk=4")
    x = torch.randint(1, 17, (3, 32, 2))
    before = model(x)
    with diag.RoutingProbe(model) as probe:
        during = model(x)
    assert torch.equal(before, during) and len(probe.captures) == 2
    layers = diag.mita_layers(model)
    assert all("attend" not in vars(layer) and not layer.record_routing for layer in layers)
    _, sdpa = _model("sdpa")
    with pytest.raises(ValueError, match="no MiTA layer"):
        diag.RoutingProbe(sdpa)


def test_task_scores_diagnostics_in_eval_only():
    cfg = task.config(overrides=["data.seq_len=32", "data.num_pairs=4", "data.vocab_size=16", "data.diagnostics=True"])
    cfg["data"].update(num_train=8, num_val=4, num_test=4)
    data = task.task_data(cfg["data"])
    t = task.recall_task(cfg, data, "mita:num_landmarks=4,topk=4")
    names = diag.metric_names(2, 2)
    assert t.metrics == ("accuracy", *names) and "experts_used_l1h1" in names
    model = t.build_model().eval()
    batch = data.splits["val"].__getitems__([0, 1, 2, 3])
    s = t.scores(model, batch)
    count = float(s.count)
    assert count == 16 and set(names) <= set(s.metrics)
    for name in names:
        value = float(s.metrics[name]) / count
        assert math.isfinite(value) and value >= 0
        if name.startswith(("recall", "target_mass", "landmark_mass", "dup_share", "lm_cosine")):
            assert value <= 1 + 1e-6
    model.train()
    assert math.isnan(float(t.scores(model, batch).metrics[names[0]]))
    with pytest.raises(ValueError, match="MiTA attention"):
        task.recall_task(cfg, data, "sdpa")
    with pytest.raises(ValueError, match="diagnostics"):
        task.config(overrides=["data.diagnostics=3"])


def test_recall_layer_defaults_are_the_spec_and_dense_share_is_training_only():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    base = MiTAAttention(32, 2, num_landmarks=4, topk=4, impl="reference").eval()
    plain = routing.RecallMiTAAttention(32, 2, num_landmarks=4, topk=4, impl="reference").eval()
    plain.load_state_dict(base.state_dict())
    assert torch.equal(plain(x), base(x))
    dense = routing.RecallMiTAAttention(32, 2, num_landmarks=4, topk=4, impl="reference", dense_steps=4)
    dense.load_state_dict({**base.state_dict(), "dense_step": torch.tensor(0)})
    assert dense.dense_share() == 1.0
    out = dense(x)  # training: all dense at step 0
    qkv = base.qkv(x).reshape(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
    sdpa = F.scaled_dot_product_attention(*qkv).transpose(1, 2).reshape(2, 16, 32)
    torch.testing.assert_close(out, base.proj(base.norm(sdpa)))
    assert int(dense.dense_step) == 1 and dense.dense_share() == 0.75
    dense.eval()
    assert dense.dense_share() == 0.0 and torch.equal(dense(x), base(x)) and int(dense.dense_step) == 1
    rope = routing.RecallMiTAAttention(32, 2, num_landmarks=4, topk=4, rope=True).eval()
    rope.load_state_dict(base.state_dict())
    assert not torch.allclose(rope(x), base(x))
    same = x[:, :1].expand(2, 16, 32)  # identical tokens: distinct under rope
    rope.record_routing = True
    rope(same)
    copies, _ = duplicate_groups(rope.attended_qk[1])
    assert (copies == 1).all()


def test_recall_layer_is_the_library_layer_with_the_fix():
    """``mita_recall`` with the fix's options (the runs' name) is the library's ``mita`` with them."""
    torch.manual_seed(0)
    opts = dict(num_landmarks=4, topk=4, landmark_pooling="distinct", merge_duplicates=True)
    lib = MiTAAttention(32, 2, **opts).double().eval()
    rec = routing.RecallMiTAAttention(32, 2, **opts).double().eval()
    rec.load_state_dict(lib.state_dict())
    tok = torch.randn(2, 3, 32, dtype=torch.float64)
    x = tok.gather(1, torch.randint(0, 3, (2, 24, 1)).expand(-1, -1, 32)).requires_grad_()
    assert torch.equal(rec(x), lib(x))
    _, model = _model("mita_recall:num_landmarks=4,topk=4,landmark_pooling=distinct,merge_duplicates=True")
    layer = model.encoder.blocks[0].attn
    assert (layer.landmark_pooling, layer.merge_duplicates, layer.rope, layer.dense_steps) == (
        "distinct",
        True,
        False,
        0,
    )


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(landmark_pooling="kmeans"), ValueError, "landmark_pooling"),
        (dict(merge_duplicates=1), TypeError, "merge_duplicates"),
        (dict(dense_steps=-1), ValueError, "dense_steps"),
        (dict(rope=1), TypeError, "rope"),
        (dict(rope=True, grid="auto"), ValueError, "1-D positions"),
    ],
)
def test_recall_layer_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        routing.RecallMiTAAttention(32, 2, num_landmarks=4, topk=4, **kwargs)


SHORT = ["data.seq_len=12", "data.num_pairs=2", "data.vocab_size=8", "data.num_train=64", "data.num_val=16"]
SHORT += ["data.num_test=16", "model.dim=16", "model.mlp_dim=32", "model.head_dim=8", "train.batch_size=8"]
SHORT += ["train.steps=4", "train.warmup=1", "train.eval_every=2", "train.log_every=2", "train.checkpoint_every=2"]


def test_training_logs_the_diagnostics_and_eval_measures_them(tmp_path, capsys):
    import csv
    import json

    from mita_experiments.cli import main

    cfg = task.config(overrides=[*SHORT, "data.diagnostics=True"])
    att = "mita_recall:num_landmarks=2,topk=3,landmark_pooling=distinct,merge_duplicates=True"
    task.train(cfg, task.task_data(cfg["data"]), tmp_path / "run", att, progress=False, tensorboard=False)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    val = [r for r in rows if r["split"] == "val"]
    assert [r["step"] for r in val] == ["2", "4"] and all(0 <= float(r["recall_l1h1"]) <= 1 for r in val)
    assert all(math.isnan(float(r["recall_l0h0"])) for r in rows if r["split"] == "train")
    from mita_experiments.recall import trajectories

    long = trajectories.collect({"fix": tmp_path / "run"}, from_init=True)
    assert [r["step"] for r in long[:: len(diag.metric_names(2, 2))]] == [0, 2, 4]
    assert len(long) == 3 * len(diag.metric_names(2, 2)) and {r["metric"] for r in long} == set(diag.METRICS)
    paths = trajectories.write(long, tmp_path / "traj")
    assert [p.suffix for p in paths] == [".csv", ".png"] and all(p.stat().st_size > 0 for p in paths)
    with pytest.raises(FileNotFoundError, match="run folder"):
        trajectories.collect({"none": tmp_path})
    argv = ["recall", "eval", "--checkpoint", str(tmp_path / "run"), "--attention", "mita:num_landmarks=2,topk=3"]
    capsys.readouterr()
    assert main([*argv, "--diagnostics"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["diagnostics"]) == set(diag.metric_names(2, 2)) and 0 <= result["accuracy"] <= 1
    assert main([*argv[:-2], "--attention", "sdpa", "--diagnostics"]) == 2  # no MiTA layer: a clear error


def test_mita_recall_is_registered_only_where_the_task_builds():
    from mita import attention

    _, model = _model("mita_recall:num_landmarks=4,topk=4,merge_duplicates=True")
    assert isinstance(model.encoder.blocks[0].attn, routing.RecallMiTAAttention)
    assert routing.NAME not in attention.names()  # the library's registry is unchanged outside
    with routing.registered():
        assert routing.NAME in attention.names()
    assert routing.NAME not in attention.names()
