"""Associative recall: generator properties, the task on the trainer, the CLI and sweep resume."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from mita_experiments.recall import data as gen
from mita_experiments.recall import task

IGN = gen.IGNORE


@pytest.mark.parametrize("form", gen.FORMS)
@pytest.mark.parametrize("N,P,V", [(16, 4, 12), (64, 8, 32), (60, 19, 40)])
def test_generator_properties(form, N, P, V):
    spec = gen.RecallSpec(N, P, V, form)
    tokens, targets = gen.generate(spec, 1100, seed=3)  # past one chunk
    assert tokens.dtype == targets.dtype == torch.int16
    key_ch = tokens if form == "interleaved" else tokens[..., 0]
    assert targets.shape == (1100, N) and key_ch.shape == (1100, N)
    half, ctx = V // 2, spec.context_len
    for seq, tgt, full in zip(key_ch.long(), targets.long(), tokens.long()):
        if form == "onehop":
            keys, values = seq[:P], full[:P, 1]
            assert (full[P:, 1] == 0).all()  # queries and filler hold no value
        else:
            keys, values = seq[0:ctx:2], seq[1:ctx:2]
        assert len(set(keys.tolist())) == P  # distinct keys
        assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < V)).all()
        assert (tgt[:ctx] == IGN).all()
        query = (tgt != IGN).nonzero().flatten()
        assert len(query) == P and (query >= ctx).all()
        assert sorted(seq[query].tolist()) == sorted(keys.tolist())  # the queries are exactly the keys
        lookup = dict(zip(keys.tolist(), values.tolist()))
        assert [lookup[k] for k in seq[query].tolist()] == tgt[query].tolist()  # each target is its key's value
        rest = torch.ones(N, dtype=torch.bool)
        rest[:ctx] = False
        rest[query] = False
        assert (seq[rest] == 0).all()  # filler elsewhere


def test_generator_is_seeded_and_prefix_stable():
    spec = gen.RecallSpec(32, 4, 16)
    a, ta = gen.generate(spec, 1500, seed=7)
    b, tb = gen.generate(spec, 1500, seed=7)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    c, tc = gen.generate(spec, 10, seed=7)
    assert torch.equal(a[:10], c) and torch.equal(ta[:10], tc)
    d, _ = gen.generate(spec, 10, seed=8)
    assert not torch.equal(c, d)
    # pinned values: the same on any machine with this PyTorch
    assert a[0, :4].tolist() == [[4, 15], [3, 11], [6, 8], [1, 12]]


def test_queries_in_random_order():
    spec = gen.RecallSpec(64, 8, 32)
    tokens, targets = gen.generate(spec, 200, seed=0)
    in_order = 0
    for seq, tgt in zip(tokens[..., 0].long(), targets.long()):
        query = (tgt != IGN).nonzero().flatten()
        in_order += seq[query].tolist() == seq[:8].tolist()
    assert in_order < 5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seq_len=16, num_pairs=8, vocab_size=16), "num_pairs"),
        (dict(seq_len=10, num_pairs=6, vocab_size=64), "seq_len"),
        (dict(seq_len=17, num_pairs=6, vocab_size=64, form="interleaved"), "seq_len"),
        (dict(seq_len=16, num_pairs=2, vocab_size=15), "vocab_size"),
        (dict(seq_len=16, num_pairs=2, form="x"), "form"),
    ],
)
def test_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gen.RecallSpec(**kwargs)


def test_save_load_roundtrip(tmp_path):
    spec = gen.RecallSpec(24, 3, 16)
    gen.save(tmp_path, spec, {"train": 20, "val": 4, "test": 5}, seed=2)
    with pytest.raises(FileExistsError, match="--force"):
        gen.save(tmp_path, spec, {"train": 20}, seed=2)
    spec2, splits = gen.load(tmp_path)
    assert spec2 == spec
    tokens, targets = gen.generate(spec, 20, gen.split_seeds(2)["train"])
    assert torch.equal(splits["train"][0], tokens) and torch.equal(splits["train"][1], targets)
    assert len(splits["test"][0]) == 5


def test_task_data_shifts_ids_and_labels():
    cfg = task.config(overrides=["data.seq_len=32", "data.num_pairs=4", "data.vocab_size=16", "data.num_train=8"])
    d = task.task_data(cfg["data"])
    split = d.splits["train"]
    tokens, targets = gen.generate(task.spec_of(cfg["data"]), 8, gen.split_seeds(0)["train"])
    assert d.vocab_size == 17 and d.num_classes == 8 and d.max_length == 32
    assert torch.equal(split.tokens[..., 0], tokens[..., 0] + 1)
    assert ((split.tokens[..., 1] == 0) == (tokens[..., 1] == 0)).all()
    keep = targets != IGN
    assert torch.equal(split.labels[keep], targets[keep] - 8) and (split.labels[~keep] == IGN).all()


@pytest.mark.parametrize("form", gen.FORMS)
def test_length_mixture_pads_and_masks_the_short_sequences(form):
    spec = gen.RecallSpec(64, 12, 40, form)
    assert [(s.seq_len, s.num_pairs) for s in gen.mix_specs(spec, [32, 16, 16])] == [(16, 4), (32, 8), (64, 12)]
    tokens, targets, lengths = gen.generate_mix(spec, [16, 32], 100, seed=5)
    assert tokens.shape[:2] == targets.shape == (100, 64) and lengths.tolist() == [16] * 34 + [32] * 33 + [64] * 33
    b, tb, _ = gen.generate_mix(spec, [16, 32], 100, seed=5)
    assert torch.equal(tokens, b) and torch.equal(targets, tb)  # seeded
    for row, tgt, n in zip(tokens.long(), targets.long(), lengths.tolist()):
        assert (row[n:] == gen.PAD).all() and (tgt[n:] == IGN).all() and (row[:n] >= 0).all()
        assert (tgt != IGN).sum() == min(12, n // 4)  # P_i = min(P, N_i // 4) queries
    short = gen.generate(gen.RecallSpec(16, 4, 40, form), 34, 5 + 1_000_000)
    assert torch.equal(tokens[:34, :16], short[0]) and torch.equal(targets[:34, :16], short[1])
    with pytest.raises(ValueError, match="train lengths"):
        gen.mix_specs(spec, [64])


def test_task_data_length_mixture_only_in_train():
    base = ["data.seq_len=32", "data.num_pairs=4", "data.vocab_size=16", "data.num_train=30", "data.num_val=8"]
    d = task.task_data(task.config(overrides=[*base, "data.train_lengths=[16]"])["data"])
    train_split, val = d.splits["train"], d.splits["val"]
    assert train_split.lengths.tolist() == [16] * 15 + [32] * 15 and (val.lengths == 32).all()
    assert (train_split.tokens[:15, 16:] == 0).all()  # padding id 0: masked by the encoder
    assert (train_split.tokens[:15, :16, 0] >= 1).all() and (train_split.tokens[15:, :, 0] >= 1).all()
    plain = task.task_data(task.config(overrides=base)["data"])
    assert torch.equal(plain.splits["val"].tokens, val.tokens)  # val and test do not change


DATA = ["data.seq_len=12", "data.num_pairs=2", "data.vocab_size=8", "data.num_train=512", "data.num_val=64"]
DATA += ["data.num_test=128", "model.dim=16", "model.mlp_dim=32", "model.head_dim=8", "train.batch_size=16"]
TINY = [*DATA, "train.steps=80", "train.warmup=10", "train.lr=0.01", "train.eval_batch_size=128"]
TINY += ["train.eval_every=1000", "train.checkpoint_every=1000", "train.log_every=1000"]


def test_sdpa_learns_above_chance(tmp_path):
    cfg = task.config(overrides=TINY)
    d = task.task_data(cfg["data"])
    summary = task.train(cfg, d, tmp_path / "run", attention="sdpa", progress=False, tensorboard=False)
    assert summary["finished"] and summary["test_accuracy_last"] > 0.6  # chance 0.25, bag of values 0.5


SHORT = [*DATA, "train.steps=6", "train.warmup=2", "train.eval_every=3", "train.checkpoint_every=2"]
SHORT += ["train.log_every=2", "train.eval_batch_size=64"]


def test_sweep_resumes_mid_run_and_skips_finished(tmp_path, monkeypatch):
    from mita_experiments import trainer
    from mita_experiments.recall import sweep

    cells = sweep.grid(["sdpa", "linear"], [12], pairs=[2], seeds=[0])
    assert [c.name for c in cells] == ["sdpa-N12-P2-s0", "linear-N12-P2-s0"]
    ref = list(sweep.sweep(cells[:1], tmp_path / "ref", SHORT))
    # a sweep killed mid-run: its first cell has a checkpoint at step 2 and no row
    out = tmp_path / "sweep"
    cfg = task.config(overrides=[*SHORT, "train.seed=0", "data.seed=0"])
    task.train(cfg, task.task_data(cfg["data"]), out / "runs" / cells[0].name, "sdpa", stop_after=2, progress=False)
    rows = list(sweep.sweep(cells, out, SHORT))
    assert [r["attention"] for r in rows] == ["sdpa", "linear"]
    assert rows[0]["test_accuracy"] == ref[0]["test_accuracy"] and rows[0]["steps"] == rows[0]["max_steps"] == 6
    a = torch.load(out / "runs" / cells[0].name / trainer.CHECKPOINT, weights_only=True)["model"]
    b = torch.load(tmp_path / "ref" / "runs" / cells[0].name / trainer.CHECKPOINT, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # re-running the finished grid trains nothing and keeps one row per run
    monkeypatch.setattr(sweep, "run_cell", lambda *a, **k: pytest.fail("a finished cell was run again"))
    assert list(sweep.sweep(cells, out, SHORT)) == []
    assert len(sweep.read_results(out)) == 2
    assert sweep.status(0.5, 0.995) == "solved" and sweep.status(0.30, 0.305) == "flat"


def test_sweep_records_the_step_a_solved_run_stopped_at(tmp_path, monkeypatch):
    from mita_experiments import trainer
    from mita_experiments.recall import sweep

    monkeypatch.setattr(trainer.loop, "evaluate", lambda *a, **k: {"loss": 0.0, "accuracy": 1.0, "samples_per_s": 1.0})
    cells = sweep.grid(["sdpa"], [12], pairs=[2])
    [row] = sweep.sweep(cells, tmp_path, [*SHORT, "train.stop_at_accuracy=0.99"])
    assert row["steps"] == 3 and row["max_steps"] == 6 and row["status"] == "solved"
    assert sweep.read_results(tmp_path)[0]["steps"] == "3"


def test_grid_and_cli(tmp_path, capsys):
    from mita_experiments.cli import main
    from mita_experiments.recall import sweep

    cells = sweep.grid(["sdpa"], [256, 512], ratio=1 / 16)
    assert [(c.seq_len, c.num_pairs) for c in cells] == [(256, 16), (512, 32)]
    with pytest.raises(ValueError, match="either pairs"):
        sweep.grid(["sdpa"], [64])
    sets = [x for item in SHORT for x in ("--set", item)]
    assert main(["recall", "generate", "--out", str(tmp_path / "data"), *sets]) == 0
    assert main(["recall", "generate", "--out", str(tmp_path / "data"), *sets]) == 2  # refuses to overwrite
    run = str(tmp_path / "run")
    args = ["recall", "train", "--out", run, "--data", str(tmp_path / "data"), "--no-progress", "--no-tensorboard"]
    assert main([*args, *sets]) == 0
    capsys.readouterr()
    table = tmp_path / "evals.csv"
    argv = ["recall", "eval", "--checkpoint", run, "--attention", "mita:num_landmarks=2,topk=4", "--csv", str(table)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert main([*argv[:-2], "--option", "topk=8", "--csv", str(table)]) == 0
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["options"] for r in rows] == ["{}", '{"topk": 8}'] and rows[1]["trained_with"] == "sdpa"
    assert result["trained_with"] == "sdpa" and result["attention"] == "mita:num_landmarks=2,topk=4"
    assert 0 <= result["accuracy"] <= 1
    out = tmp_path / "sw"
    argv = ["recall", "sweep", "--out", str(out), "--methods", "sdpa", "--lengths", "12", "--pairs", "1", "2"]
    assert main([*argv, "--no-progress", *sets]) == 0
    assert (out / "acc_vs_pairs.png").is_file() and len(sweep.read_results(out)) == 2
    capsys.readouterr()
    assert main(["recall", "report", "--out", str(out)]) == 0
    assert "| `sdpa` |" in capsys.readouterr().out


def test_plots_are_written_where_a_line_has_two_points(tmp_path) -> None:
    from mita_experiments.recall import sweep

    def row(method: str, n: int, p: int, acc: float) -> dict[str, str]:
        return {"attention": method, "seq_len": str(n), "num_pairs": str(p), "test_accuracy": str(acc)}

    at_p = [row(m, n, 32, a) for m, a in (("sdpa", 0.9), ("mita", 0.1)) for n in (512, 1024)]
    assert [p.name for p in sweep.plot(tmp_path, at_p)] == ["acc_vs_length_at_p.png"]
    ratio = [row("sdpa", 64, 8, 1.0), row("sdpa", 128, 16, 0.9), row("sdpa", 128, 32, 0.8)]
    assert [p.name for p in sweep.plot(tmp_path, ratio)] == ["acc_vs_pairs.png", "acc_vs_length.png"]


def test_sweep_checks_overrides_at_each_cells_length(tmp_path, monkeypatch, capsys):
    """A length mixture longer than the default N is valid at the cells' N (the N = 512 sweep of
    docs/zoo.md), and one too long for a cell is refused before any run."""
    from mita_experiments.cli import main
    from mita_experiments.recall import sweep

    cell = sweep.grid(["sdpa"], [512], pairs=[32])[0]
    cfg = sweep.cell_config(cell, ["data.vocab_size=128", "data.train_lengths=[64,128,256]"], batch_tokens=4096)
    assert cfg["data"]["seq_len"] == 512 and cfg["data"]["train_lengths"] == [64, 128, 256]
    assert cfg["train"]["batch_size"] == 8  # min(32, 4096 // 512)
    monkeypatch.setattr(sweep, "run_cell", lambda *a, **k: pytest.fail("a cell ran before the checks"))
    args = ["recall", "sweep", "--out", str(tmp_path), "--methods", "sdpa", "--lengths", "512", "256", "--pairs", "8"]
    assert main([*args, "--set", "data.train_lengths=[64,300]", "--no-progress"]) == 2
    assert "train lengths must be in 4 .. seq_len-1 = 255, got 300" in capsys.readouterr().err
