"""The digits experiments on a few images: reports, figures, closed-form selection statistics, resume."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("matplotlib")

from mita_experiments import trainer
from mita_experiments.cli import main
from mita_experiments.utils.distributed import Dist
from mita_experiments.vision import digits, experiments
from mita_experiments.vision.digits import DigitsSetup

TINY = dict(epochs=1, batch_size=16, embed_dim=16, depth=1, num_heads=2)


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, ...]:
    """32 training and 16 test images of the real digits."""
    x_train, y_train, x_test, y_test = digits.load_digits(seed=0)
    return x_train[:32], y_train[:32], x_test[:16], y_test[:16]


def quiet(_: str) -> None:
    pass


def trained(setup: DigitsSetup, run) -> torch.nn.Module:
    """The digits model of ``setup`` with the final weights of the run folder ``run``."""
    model = digits.make_vit(setup)
    model.load_state_dict(trainer.read_checkpoint(run / trainer.WEIGHTS)["model"])
    return model


def test_load_digits_shapes_and_range():
    x_train, _, x_test, y_test = digits.load_digits(seed=0)
    assert x_train.shape == (1437, 1, 32, 32) and x_test.shape == (360, 1, 32, 32)
    torch.testing.assert_close((x_train.mean(), x_train.std()), (torch.tensor(0.0), torch.tensor(1.0)))
    assert sorted(set(y_test.tolist())) == list(range(10))


def test_swap_report(tmp_path, data):
    configs = ["sdpa", "mita:num_landmarks=4,topk=4", "mita:num_landmarks=64,topk=65"]
    rows = experiments.run_swap(tmp_path, DigitsSetup(**TINY), configs, "cmd", log=quiet, data=data)
    assert [r["attention at test time"] for r in rows] == configs
    base = 100 * digits.evaluate(trained(DigitsSetup(**TINY), tmp_path / "sdpa"), data[2], data[3])
    assert rows[0]["test accuracy (%)"] == pytest.approx(base)
    for row in rows:  # the share of the SDPA model's accuracy (undefined if that is 0)
        expected = 100 * row["test accuracy (%)"] / base if base else float("nan")
        assert row["retained (%)"] == pytest.approx(expected, nan_ok=True)
    assert (tmp_path / "swap.png").stat().st_size > 0
    assert "| mita:num_landmarks=4,topk=4 |" in (tmp_path / "report.md").read_text()


def test_swap_configs_cover_the_registry_and_fit_the_digits_grid():
    from mita.models.convert import convert

    configs = experiments.swap_configs()
    assert {c.partition(":")[0] for c in configs} == set(experiments.registry.names())
    for config in configs:
        assert convert(digits.make_vit(DigitsSetup(**TINY)), config)(torch.randn(1, 1, 32, 32)).shape == (1, 10)
    experiments.check_attentions(experiments.DIGITS, DigitsSetup(**TINY), configs, "--attention")


def test_sized_options_size_every_method_of_one_length():
    options = experiments.sized_options(landmarks=9, topk=20, block_size=8, window=4, nystrom=12)
    assert options["mita"] == options["mita_routed"] == {"num_landmarks": 9, "topk": 20}
    assert options["mita_shared"] is not options["mita"]  # one table's entries are not each other's
    assert (options["agent"], options["mhla"], options["topk"]) == ({"num_agents": 9}, {"num_blocks": 9}, {"topk": 20})
    assert options["nystrom"] == {"num_landmarks": 12}
    assert options["nsa"] == {"block_size": 8, "topk": 2, "window": 4} and options["moba"]["block_size"] == 8
    assert experiments.sized_options(16, 16, 8, 4)["nystrom"] == {"num_landmarks": 16}
    assert set(options) <= set(experiments.registry.names())


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["swap", "--attention", "sdpa", "mita:num_landmarks=5,topk=4"], "--attention mita:num_landmarks=5,topk=4: "),
        (["swap", "--attention", "agent:num_agents=7"], "num_agents=7 with a 2-D grid must be a perfect square"),
        (["swap", "--attention", "nope"], "--attention nope: .*not a registered"),
        (["robustness", "--m", "4", "5"], "--m/--k give mita:num_landmarks=5,topk=1: .*perfect square"),
        (["robustness", "--k", "0"], "topk must be an int >= 1, got 0"),
        (["robustness", "--train-attention", "mita:num_landmarks=3,topk=4"], "--train-attention mita:num_landmarks=3"),
        (["pruning", "--train-attention", "mita:num_landmarks=6"], "--train-attention mita:num_landmarks=6: "),
    ],
    ids=["swap-m", "swap-agents", "swap-unknown", "robustness-m", "robustness-k", "robustness-train", "pruning"],
)
def test_every_attention_is_checked_before_training(tmp_path, capsys, monkeypatch, argv, match):
    """A bad option of any attention the command will use is refused at once (exit 2, one line), not after training."""

    def no_training(*args, **kwargs):
        raise AssertionError("trained before the attentions were checked")

    monkeypatch.setattr(experiments, "train", no_training)
    assert main(["vision", *argv, "--epochs", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err


def test_robustness_grid(tmp_path, data):
    setup = DigitsSetup(attention="mita:num_landmarks=4,topk=4", **TINY)
    result = experiments.run_robustness(tmp_path, setup, (1, 4), (2, 65), "cmd", log=quiet, data=data)
    assert result["grid"].shape == (2, 2)
    model = trained(setup, tmp_path / "mita")
    for layer in experiments.mita_layers(model):
        layer.num_landmarks, layer.topk = 4, 65
    assert float(result["grid"][1, 1]) == pytest.approx(100 * digits.evaluate(model, data[2], data[3]))
    assert (tmp_path / "robustness.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("attention", "ms", "match"),
    [("mita:num_landmarks=4,topk=4", (3,), "perfect square"), ("sdpa", (4,), r"must be a 'mita:\.\.\.' config")],
    ids=["m-not-square", "not-mita"],
)
def test_robustness_errors(tmp_path, attention, ms, match):
    with pytest.raises(ValueError, match=match):
        experiments.run_robustness(tmp_path, DigitsSetup(attention=attention, **TINY), ms, (4,), "cmd")


@pytest.mark.parametrize(
    ("m", "k", "unselected"), [(64, 65, 0.0), (1, 1, 64 / 65), (1, 65, 0.0)], ids=["all", "one-key", "one-expert"]
)
def test_selection_statistics_closed_form(m, k, unselected):
    model = digits.make_vit(DigitsSetup(attention=f"mita:num_landmarks={m},topk={k}", embed_dim=16, depth=2))
    stats = experiments.selection_statistics(model, torch.rand(3, 1, 32, 32))
    assert stats["unselected_head"].shape == (2,)
    torch.testing.assert_close(stats["unselected_head"], torch.full((2,), unselected))
    assert stats["frequency"].shape == (2, 65) and stats["per_image"].shape == (2, 3, 65)
    assert not any(layer.record_routing for layer in experiments.mita_layers(model))


def test_selection_statistics_needs_mita():
    with pytest.raises(ValueError, match="no MiTAAttention"):
        experiments.selection_statistics(digits.make_vit(DigitsSetup(**TINY)), torch.rand(1, 1, 32, 32))


def test_chance_unselected():
    assert experiments.chance_unselected(65, 16, 16) == pytest.approx((49 / 65) ** 16)
    assert experiments.chance_unselected(65, 2, 100) == 0


def test_pruning_report(tmp_path, data):
    setup = DigitsSetup(attention="mita:num_landmarks=4,topk=8", **TINY)
    stats = experiments.run_pruning(tmp_path, setup, "cmd", log=quiet, data=data)
    assert stats["unselected_head"].shape == (1,)
    assert float(stats["unselected_head"][0]) >= 1 - 4 * 8 / 65  # at most m k distinct tokens
    for name in ("selection_frequency.png", "selection_examples.png", "report.md"):
        assert (tmp_path / name).stat().st_size > 0
    with pytest.raises(ValueError, match=r"must be a 'mita:\.\.\.' config"):
        experiments.run_pruning(tmp_path, DigitsSetup(**TINY), "cmd", data=data)


def test_training_resumes_exactly(tmp_path, data):
    """A run stopped after its first step and trained again ends with an uninterrupted run's weights."""
    setup = DigitsSetup(**{**TINY, "epochs": 2})
    straight, _ = digits.train(setup, data, tmp_path / "straight", progress=False)
    task, config = digits.training(setup, data)
    trainer.train(task, config, tmp_path / "cut", stop_after=1, progress=False, tensorboard=False, ctx=Dist())
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["step"] == 1
    resumed, summary = digits.train(setup, data, tmp_path / "cut", progress=False)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert 0 <= summary["test_accuracy"] <= 1 and summary["train_seconds"] > 0


def test_run_of_another_setup(tmp_path, data):
    run = tmp_path / "run"
    digits.train(DigitsSetup(**TINY), data, run, progress=False)
    other = DigitsSetup(**{**TINY, "seed": 1})
    with pytest.raises(ValueError, match="use another output folder or --force"):
        digits.train(other, data, run, progress=False)
    with pytest.raises(ValueError, match="digits run of"):
        digits.train(DigitsSetup(**TINY), data, run, name="moving digits", progress=False)
    digits.train(other, data, run, force=True, progress=False)
    assert trainer.read_manifest(run)["config"]["setup"] == asdict(other)


def test_batch_larger_than_the_data(data):
    with pytest.raises(ValueError, match="--batch-size 64 exceeds the 32 training examples"):
        digits.training(DigitsSetup(**{**TINY, "batch_size": 64}), data)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"epochs": 0}, "epochs must be"), ({"lr": 0.0}, "lr must be"), ({"attention": "nope"}, "not a registered")],
    ids=["epochs", "lr", "attention"],
)
def test_setup_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsSetup(**kwargs)


def test_output_folder_rules(tmp_path, capsys):
    (tmp_path / "report.md").write_text("old")
    with pytest.raises(FileExistsError, match="--force"):
        experiments.prepare_output(tmp_path, force=False)
    assert experiments.prepare_output(tmp_path, force=True) == tmp_path
    with pytest.raises(ValueError, match="is a file"):
        experiments.prepare_output(tmp_path / "report.md", force=True)
    for command in ("swap", "robustness", "pruning"):
        assert main(["vision", command, "--out", str(tmp_path)]) == 2
        assert "not empty; pass --force" in capsys.readouterr().err
    assert (tmp_path / "report.md").read_text() == "old"
