"""LRA on the trainer: exact resume (also after a kill), accumulation, DDP, eval with swapped attention, CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from mita_experiments import trainer
from mita_experiments.cli import main as cli_main
from mita_experiments.lra import train as T
from mita_experiments.lra.config import load_config
from mita_experiments.lra.data import listops, loaders
from mita_experiments.utils.distributed import Dist

SPEC = listops.ListOpsSpec(num_train=48, num_val=8, num_test=8, min_length=8, max_length=40, max_depth=4, seed=5)
MITA = "mita:num_landmarks=4,topk=4"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    listops.generate(out, SPEC)
    return out


@pytest.fixture(scope="module")
def data(data_dir):
    return loaders.load_listops(data_dir, max_length=40)


def tiny_config(**train):
    config = load_config("listops", "small")
    config["data"]["loader"] = {"max_length": 40}
    config["model"].update(dim=16, depth=1, num_heads=2, mlp_dim=32, head_dim=8)
    defaults = dict(
        batch_size=8, steps=6, warmup=2, eval_every=3, checkpoint_every=2, log_every=2, eval_batch_size=8, lr=1e-3
    )
    config["train"].update({**defaults, **train})
    return config


def train_args(cfg_file, data_dir, out):
    """``mita lra train`` of ListOps with the config file, on the CPU, MiTA, into ``out``, quietly."""
    cmd = ["lra", "train", "--task", "listops", "--config", str(cfg_file), "--data", str(data_dir)]
    return [*cmd, "--attention", MITA, "--out", str(out), "--no-progress", "--no-tensorboard", "--device", "cpu"]


def weights(run_dir):
    return torch.load(run_dir / trainer.CHECKPOINT, map_location="cpu", weights_only=True)["model"]


def assert_same(a, b, exact=True):
    assert a.keys() == b.keys()
    for key in a:
        if exact:
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("attention", ["sdpa", MITA], ids=["sdpa", "mita"])
def test_stopped_and_resumed_run_is_bit_identical(tmp_path, data, attention):
    config = tiny_config()
    full = T.train(config, data, tmp_path / "full", attention, progress=False, tensorboard=False)
    assert full["finished"] and full["step"] == 6
    part = T.train(config, data, tmp_path / "part", attention, stop_after=3, progress=False, tensorboard=False)
    assert not part["finished"] and part["step"] == 3
    T.train(config, data, tmp_path / "part", attention, resume=True, progress=False, tensorboard=False)
    assert_same(weights(tmp_path / "full"), weights(tmp_path / "part"))
    rows = (tmp_path / "part" / trainer.METRICS).read_text().splitlines()
    assert rows == (tmp_path / "full" / trainer.METRICS).read_text().splitlines()[: len(rows)] or len(rows) > 1
    steps = [int(r.split(",")[0]) for r in rows[1:] if ",train," in r]
    assert steps == [2, 4, 6]  # no duplicated rows after the resume


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
def test_killed_run_resumes_exactly(tmp_path, data_dir, data):
    """A training process killed with SIGKILL resumes from its last checkpoint to the same weights."""
    config = tiny_config(steps=12, checkpoint_every=1, eval_every=100)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(config))
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "mita_experiments", *train_args(cfg_file, data_dir, run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (run / trainer.CHECKPOINT).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run / trainer.CHECKPOINT).exists(), proc.stderr.read().decode()
    subprocess.run([*cmd, "--resume"], check=True, capture_output=True)
    T.train(config, data, tmp_path / "full", MITA, progress=False, tensorboard=False)
    assert_same(weights(tmp_path / "full"), weights(run))


def test_gradient_accumulation_matches_one_batch(tmp_path, data):
    config = tiny_config(steps=3)
    config["model"].update(dropout=0.0, attn_dropout=0.0)
    T.train(config, data, tmp_path / "one", progress=False, tensorboard=False)
    config["train"]["accum"] = 4
    T.train(config, data, tmp_path / "four", progress=False, tensorboard=False)
    assert_same(weights(tmp_path / "one"), weights(tmp_path / "four"), exact=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_one(tmp_path, data_dir, data, capsys):
    config = tiny_config(steps=3)
    config["model"].update(dropout=0.0, attn_dropout=0.0)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(config))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        "mita_experiments",
        *train_args(cfg_file, data_dir, tmp_path / "ddp"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    T.train(config, data, tmp_path / "single", MITA, progress=False, tensorboard=False)
    assert_same(weights(tmp_path / "single"), weights(tmp_path / "ddp"), exact=False)
    assert torch.load(tmp_path / "ddp" / trainer.CHECKPOINT, weights_only=True)["world_size"] == 2
    # issue 25 item 12: the 2-process run is not resumed by one process, and the refusal says how
    resume = ["lra", "train", "--task", "listops", "--config", str(cfg_file), "--data", str(data_dir)]
    resume += ["--out", str(tmp_path / "ddp"), "--resume", "--set", "train.steps=5", "--device", "cpu"]
    assert cli_main([*resume, "--no-progress", "--no-tensorboard"]) == 2
    assert "--nproc_per_node 2" in capsys.readouterr().err


def test_run_dir_is_never_overwritten(tmp_path, data):
    config = tiny_config(steps=2)
    T.train(config, data, tmp_path / "run", progress=False, tensorboard=False)
    with pytest.raises(FileExistsError, match="--resume"):
        T.train(config, data, tmp_path / "run", progress=False, tensorboard=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a run's"):
        T.train(config, data, tmp_path / "other", progress=False, tensorboard=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_run_killed_before_its_first_checkpoint_leaves_a_reusable_folder(tmp_path, data, capsys):
    """A folder holding only what a run writes before its first checkpoint (the manifest, logs)
    is reused, with or without --resume; --resume there starts from step 0."""
    config = tiny_config(steps=2)
    run = tmp_path / "run"
    run.mkdir()
    (run / trainer.MANIFEST).write_text(json.dumps({"config": config, "attention": "sdpa"}))
    (run / trainer.METRICS).write_text("step,epoch\n")
    (run / "tb").mkdir()
    assert T.train(config, data, run, progress=False, tensorboard=False)["finished"]
    (run / trainer.CHECKPOINT).unlink()
    (run / trainer.BEST).unlink()
    (run / trainer.WEIGHTS).unlink()
    (run / "summary.json").unlink()
    assert T.train(config, data, run, resume=True, progress=False, tensorboard=False)["step"] == 2
    assert "starts from step 0" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert T.train(config, data, tmp_path / "empty", resume=True, progress=False, tensorboard=False)["finished"]


@pytest.mark.parametrize(
    "update, match",
    [
        ({"batch_size": 6, "accum": 4}, "divisible"),
        ({"precision": "fp16"}, "CUDA"),
        ({"precision": "fp8"}, "precision"),
        ({"stop_at_accuracy": 1.5}, "stop_at_accuracy"),
        ({"stop_at_accuracy": "0.9"}, "stop_at_accuracy"),
    ],
    ids=["indivisible-batch", "fp16-on-cpu", "unknown-precision", "stop-above-1", "stop-not-a-number"],
)
def test_train_config_errors(tmp_path, data, update, match):
    with pytest.raises(ValueError, match=match):
        T.train(tiny_config(**update), data, tmp_path / "bad", progress=False, tensorboard=False, ctx=Dist())


def test_stop_at_accuracy_ends_the_run_as_finished_and_stays_stopped(tmp_path, data, monkeypatch):
    monkeypatch.setattr(trainer.loop, "evaluate", lambda *a, **k: {"loss": 0.0, "accuracy": 1.0, "samples_per_s": 1.0})
    config = tiny_config(stop_at_accuracy=0.99)
    summary = T.train(config, data, tmp_path / "run", progress=False, tensorboard=False)
    assert summary["finished"] and summary["step"] == summary["solved_at"] == 3  # the first validation
    assert summary["test_accuracy_last"] == 1.0 and summary["steps"] == 6
    again = T.train(config, data, tmp_path / "run", resume=True, progress=False, tensorboard=False)
    assert again["step"] == 3 and again["finished"]
    plain = T.train(tiny_config(), data, tmp_path / "plain", progress=False, tensorboard=False)
    assert plain["step"] == 6 and "solved_at" not in plain  # off by default


def test_bf16_autocast_trains_on_cpu(tmp_path, data):
    summary = T.train(
        tiny_config(steps=2, precision="bf16"), data, tmp_path / "bf16", MITA, progress=False, tensorboard=False
    )
    assert summary["finished"] and all(torch.isfinite(w).all() for w in weights(tmp_path / "bf16").values())


def test_eval_swaps_attention_and_options(tmp_path, data):
    T.train(tiny_config(), data, tmp_path / "run", "sdpa", progress=False, tensorboard=False)
    same = T.evaluate_checkpoint(tmp_path / "run", data)
    assert same["attention"] == "sdpa" and 0.0 <= same["accuracy"] <= 1.0
    # MiTA with every key in one expert and one landmark per token is exact softmax attention.
    n = data.max_length
    exact = T.evaluate_checkpoint(tmp_path / "run", data, attention=f"mita:num_landmarks=1,topk={n}")
    assert 0.0 <= exact["accuracy"] <= 1.0
    assert exact["trained_with"] == "sdpa" and exact["attention"].startswith("mita")
    big = T.evaluate_checkpoint(tmp_path / "run", data, attention=MITA, options={"topk": 8, "num_landmarks": 8})
    assert big["options"] == {"topk": 8, "num_landmarks": 8}
    with pytest.raises(ValueError, match="has no option"):
        T.evaluate_checkpoint(tmp_path / "run", data, options={"nonsense": 1})
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        T.evaluate_checkpoint(tmp_path / "nowhere", data)


def test_cli_train_eval_and_refusals(tmp_path, data_dir, capsys):
    run = str(tmp_path / "cli")
    base = ["--task", "listops", "--variant", "small", "--data", str(data_dir), "--device", "cpu"]
    sets = [
        "--set",
        "data.loader={'max_length': 40}",
        "--set",
        "train.steps=2",
        "--set",
        "train.batch_size=8",
        "--set",
        "model.dim=16",
        "--set",
        "model.mlp_dim=16",
        "--set",
        "model.head_dim=8",
    ]
    assert cli_main(["lra", "train", *base, *sets, "--out", run, "--no-progress", "--attention", MITA]) == 0
    assert (tmp_path / "cli" / "tb").is_dir() and (tmp_path / "cli" / "summary.json").exists()
    assert cli_main(["lra", "train", *base, *sets, "--out", run, "--no-progress"]) == 2
    assert "--resume" in capsys.readouterr().err
    out = tmp_path / "eval.json"
    assert cli_main(["lra", "eval", *base, *sets, "--checkpoint", run, "--option", "topk=8", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["options"] == {"topk": 8}
    assert cli_main(["lra", "eval", *base, *sets, "--checkpoint", run, "--out", str(out)]) == 2
    assert cli_main(["lra", "train", *base, "--set", "train.nope=1", "--out", str(tmp_path / "x")]) == 2
    assert "unknown key 'nope'" in capsys.readouterr().err


def test_cli_generate(tmp_path, capsys):
    gen = "data.generate={'num_train': 6, 'num_val': 2, 'num_test': 2, 'min_length': 5, 'max_length': 20, 'seed': 1}"
    args = ["lra", "generate", "--task", "listops", "--out", str(tmp_path / "lo"), "--set", gen]
    assert cli_main(args) == 0
    assert len((tmp_path / "lo" / "basic_train.tsv").read_text().splitlines()) == 7
    assert cli_main(args) == 2 and "--force" in capsys.readouterr().err
    pf = "data.generate={'size': 32, 'contour_length': 6, 'num_distractors': 0, 'num_samples': 4, 'seed': 2}"
    grid = tmp_path / "grid.png"
    argv = ["lra", "generate", "--task", "pathfinder", "--out", str(tmp_path / "pf"), "--set", pf, "--grid", str(grid)]
    assert cli_main(argv) == 0
    assert grid.exists() and len(list((tmp_path / "pf").rglob("*.png"))) == 4
    assert cli_main(["lra", "generate", "--task", "text", "--out", str(tmp_path / "t")]) == 2
    assert "no generator" in capsys.readouterr().err


def test_speed_times_the_task_model_and_lra_has_no_speed_command(capsys):
    config = load_config("listops", "cpu", ["model.dim=16", "model.mlp_dim=16", "model.head_dim=8"])
    rows = list(T.speed("listops", config, MITA, [16, 32], batch_size=2, steps=1, mode="eval"))
    assert [r["length"] for r in rows] == [16, 32] and all(r["seconds_per_step"] > 0 for r in rows)
    assert set(rows[0]) == {"attention", "length", "mode", "batch_size", "seconds_per_step", "samples_per_s"}
    [row] = T.speed("retrieval", config, "sdpa", [8], batch_size=2, steps=1, warmup=0, mode="train")
    assert row["mode"] == "train" and row["samples_per_s"] > 0
    with pytest.raises(ValueError, match="mode"):
        list(T.speed("listops", config, "sdpa", [8], 2, mode="fast"))
    with pytest.raises(ValueError, match="lengths"):
        list(T.speed("listops", config, "sdpa", [0], 2))
    with pytest.raises(SystemExit):
        cli_main(["lra", "speed", "--task", "listops", "--lengths", "8"])
    assert "invalid choice: 'speed'" in capsys.readouterr().err


def test_resume_applies_steps_and_cadence_and_refuses_model_attention_changes(tmp_path, data_dir, capsys):
    run = str(tmp_path / "run")
    base = ["--task", "listops", "--variant", "small", "--data", str(data_dir), "--device", "cpu", "--no-progress"]
    small = ["--set", "data.loader={'max_length': 40}", "--set", "train.batch_size=8", "--set", "model.dim=16"]
    small += ["--set", "model.mlp_dim=16", "--set", "model.head_dim=8", "--no-tensorboard"]
    assert cli_main(["lra", "train", *base, *small, "--set", "train.steps=2", "--out", run]) == 0
    resume = ["lra", "train", "--task", "listops", "--data", str(data_dir), "--device", "cpu", "--no-progress"]
    resume += ["--no-tensorboard", "--out", run, "--resume"]
    assert cli_main([*resume, "--set", "train.steps=4", "--set", "train.eval_every=2"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 4
    capsys.readouterr()
    assert cli_main([*resume, "--set", "model.dim=32"]) == 2
    assert "--resume cannot change model.dim" in capsys.readouterr().err
    assert cli_main([*resume, "--attention", MITA]) == 2
    assert "attention cannot change on resume" in capsys.readouterr().err
