"""Issue 25 at the command line: `mita lra train|eval` and `mita recall train|eval` on the shared
trainer. Each test names the item it guards; each failed on the code before the trainer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mita_experiments.cli import main
from mita_experiments.lra.data import listops, pathfinder

SPEC = listops.ListOpsSpec(num_train=48, num_val=8, num_test=8, min_length=8, max_length=40, max_depth=4, seed=5)
LRA = {
    "data": {"loader": {"max_length": 40}},
    "model": {
        "dim": 16,
        "depth": 1,
        "num_heads": 2,
        "mlp_dim": 32,
        "head_dim": 8,
        "pooling": "mean",
        "positions": "learned",
        "dropout": 0.1,
        "attn_dropout": 0.0,
    },
    "train": {
        "seed": 0,
        "accum": 1,
        "precision": "fp32",
        "grad_clip": None,
        "betas": [0.9, 0.999],
        "eval_samples": None,
        "train_subset": None,
        "batch_size": 8,
        "steps": 4,
        "lr": 0.001,
        "schedule": "linear",
        "warmup": 1,
        "weight_decay": 0.0,
        "log_every": 2,
        "eval_every": 2,
        "checkpoint_every": 2,
        "eval_batch_size": 8,
    },
}
RECALL = ["data.seq_len=12", "data.num_pairs=2", "data.vocab_size=8", "data.num_train=64", "data.num_val=16"]
RECALL += ["data.num_test=16", "model.dim=16", "model.mlp_dim=32", "model.head_dim=8", "train.batch_size=16"]
RECALL += ["train.steps=6", "train.eval_every=3", "train.checkpoint_every=3", "train.log_every=3"]
QUIET = ["--no-progress", "--no-tensorboard", "--device", "cpu"]


def _sets(items):
    return [x for item in items for x in ("--set", item)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    listops.generate(out, SPEC)
    return out


def lra_config(tmp_path, **model):
    path = tmp_path / "lra.json"
    path.write_text(json.dumps({**LRA, "model": {**LRA["model"], **model}}))
    return path


def lra_train(tmp_path, data_dir, out, *extra, config=None):
    config = config or lra_config(tmp_path)
    argv = ["lra", "train", "--task", "listops", "--config", str(config), "--data", str(data_dir), "--out", str(out)]
    return main([*argv, *QUIET, *extra])


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


BAD = [
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.lr=-0.001", "train.lr"),
    ("train.warmup=-1", "train.warmup"),
    ("train.weight_decay=-1", "train.weight_decay"),
    ("train.eval_every=0", "train.eval_every"),
    ("train.checkpoint_every=-2", "train.checkpoint_every"),
    ("train.schedule=cos", "train.schedule"),
    ("model.dropout=1.0", "model.dropout"),
    ("model.dim=-4", "model.dim"),
    ("model.depth=0", "model.depth"),
]


@pytest.mark.parametrize("command", ["lra", "recall"])
@pytest.mark.parametrize("setting, key", BAD, ids=[b[0] for b in BAD])
def test_out_of_domain_numbers_are_refused_before_any_work(tmp_path, data_dir, capsys, command, setting, key):
    """Items 1, 6 and 15: every number checked where the config is made, one line, exit 2, nothing written."""
    out = tmp_path / "run"
    if command == "lra":
        rc = lra_train(tmp_path, data_dir, out, "--set", setting)
    else:
        rc = main(["recall", "train", "--out", str(out), *QUIET, *_sets([*RECALL, setting])])
    assert rc == 2
    assert key in one_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_stale_temporary_of_a_killed_first_save_does_not_block_the_run(tmp_path, data_dir, capsys):
    """Item 5: a folder holding only a killed save's temporary is resumable and restartable;
    `lra train` has a real --force."""
    for i, extra in enumerate([["--resume"], []]):
        out = tmp_path / f"run{i}"
        out.mkdir()
        (out / ".checkpoint.pt.x1y2z3ab.tmp").write_bytes(b"half a checkpoint")
        assert lra_train(tmp_path, data_dir, out, *extra) == 0, capsys.readouterr().err
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
        assert json.loads((out / "summary.json").read_text())["finished"]
    capsys.readouterr()
    assert lra_train(tmp_path, data_dir, tmp_path / "run0") == 2
    assert "--force to start it over" in one_line(capsys.readouterr().err)
    (tmp_path / "run0" / "notes.txt").write_text("mine")
    assert lra_train(tmp_path, data_dir, tmp_path / "run0", "--force", "--set", "train.steps=2") == 0
    assert json.loads((tmp_path / "run0" / "summary.json").read_text())["step"] == 2
    assert (tmp_path / "run0" / "notes.txt").read_text() == "mine"


def test_recall_resume_uses_the_runs_attention(tmp_path, capsys):
    """Item 7: `recall train --resume` without --attention continues with the run's attention."""
    out = str(tmp_path / "run")
    args = ["recall", "train", "--out", out, *QUIET, *_sets(RECALL)]
    assert main([*args, "--attention", "linear", "--stop-after", "3"]) == 0
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["attention"] == "linear" and summary["finished"]


def test_resume_on_other_data_is_refused_naming_it(tmp_path, data_dir, capsys):
    """Item 8: a resume pointed at another ListOps folder of the same sizes is refused."""
    other = tmp_path / "other"
    listops.generate(other, listops.ListOpsSpec(**{**SPEC.__dict__, "seed": 6}))
    out = tmp_path / "run"
    assert lra_train(tmp_path, data_dir, out, "--stop-after", "2") == 0
    capsys.readouterr()
    assert lra_train(tmp_path, other, out, "--resume") == 2
    err = one_line(capsys.readouterr().err)
    assert "not the data the run was trained on" in err and "splits.train.sha256" in err


def _edit_safetensors(src, dst, **model):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        metadata = dict(f.metadata())
    for key, text in metadata.items():
        value = json.loads(text)
        value["config"]["model"].update(model)
        metadata[key] = json.dumps(value)
    save_file(tensors, str(dst), metadata)


def test_eval_refuses_weights_that_do_not_fit_the_model(tmp_path, data_dir, capsys):
    """Item 11: a checkpoint missing a layer, metadata saying depth 1 for two-layer weights, and
    weights of other shapes are refused in one line, naming the keys."""
    out = tmp_path / "run"
    assert lra_train(tmp_path, data_dir, out, config=lra_config(tmp_path, depth=2)) == 0
    base = ["lra", "eval", "--task", "listops", "--config", str(lra_config(tmp_path)), "--data", str(data_dir)]
    base += ["--device", "cpu"]
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    dropped = "encoder.blocks.1.mlp.0.weight"
    del state["model"][dropped]
    torch.save(state, tmp_path / "missing.pt")
    _edit_safetensors(out / "model.safetensors", tmp_path / "depth1.safetensors", depth=1)
    _edit_safetensors(out / "model.safetensors", tmp_path / "wide.safetensors", dim=32, head_dim=16)
    capsys.readouterr()
    for name, expected in [
        ("missing.pt", f"missing keys: {dropped}"),
        ("depth1.safetensors", "unexpected keys: encoder.blocks.1."),
        ("wide.safetensors", "other shapes: encoder."),
    ]:
        assert main([*base, "--checkpoint", str(tmp_path / name)]) == 2
        assert expected in one_line(capsys.readouterr().err)


def test_refused_inputs_are_one_line_not_tracebacks(tmp_path, data_dir, capsys):
    """Item 15: a JSON list as --config, --device nope, --device cuda without CUDA."""
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert lra_train(tmp_path, data_dir, tmp_path / "a", config=listed) == 2
    assert "holds a JSON list" in one_line(capsys.readouterr().err)
    devices = ["nope", *([] if torch.cuda.is_available() else ["cuda"])]
    for device in devices:
        argv = ["lra", "train", "--task", "listops", "--config", str(lra_config(tmp_path)), "--data", str(data_dir)]
        assert main([*argv, "--out", str(tmp_path / "b"), "--device", device]) == 2
        assert f"--device {device}" in one_line(capsys.readouterr().err).replace("'", "")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_recall_data_outside_the_vocabulary_or_its_folder_is_refused(tmp_path, capsys):
    """Item 15: tokens >= the vocabulary; item 18: a split name that leads outside --data."""
    data = tmp_path / "data"
    assert main(["recall", "generate", "--out", str(data), *_sets(RECALL)]) == 0
    with np.load(data / "train.npz") as f:
        tokens, targets = f["tokens"].copy(), f["targets"]
    np.savez(tmp_path / "x.npz", tokens=tokens, targets=targets)
    tokens[0, 0, 0] = 8 + 5
    np.savez(data / "train.npz", tokens=tokens, targets=targets)
    args = ["recall", "train", *QUIET, *_sets(RECALL), "--data", str(data)]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "r1")]) == 2
    assert "train.npz: tokens range over 0 .. 13, outside the vocabulary 0 .. 7" in one_line(capsys.readouterr().err)
    meta = json.loads((data / "meta.json").read_text())
    meta["sizes"] = {"../x": meta["sizes"]["train"], "val": 16, "test": 16}
    (data / "meta.json").write_text(json.dumps(meta))
    assert main([*args, "--out", str(tmp_path / "r2")]) == 2
    assert "names the split '../x'" in one_line(capsys.readouterr().err)


ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}  # runs compared bitwise must use the same threads


def _subprocess_train(tmp_path, data_dir, out, config, env=ONE_THREAD, **popen):
    cmd = [sys.executable, "-m", "mita_experiments", "lra", "train", "--task", "listops", "--config", str(config)]
    cmd += ["--data", str(data_dir), "--out", str(out), *QUIET]
    return cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, **popen)


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_ctrl_c_saves_a_checkpoint_and_exits_130_with_one_line(tmp_path, data_dir):
    """Item 15: Ctrl-C during training: a checkpoint, one line, exit status 130; the resumed run is exact."""
    train = {**LRA["train"], "schedule": "constant", "steps": 3000, "checkpoint_every": 1000}
    config = tmp_path / "long.json"
    config.write_text(json.dumps({**LRA, "train": train}))
    out = tmp_path / "run"
    cmd, proc = _subprocess_train(tmp_path, data_dir, out, config)
    deadline = time.time() + 120
    while not (out / "metrics.csv").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    line = one_line(err)
    assert line.startswith("mita lra: interrupted at step") and "continue with --resume" in line
    step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
    assert 0 < step < 3000
    more = ["--set", f"train.steps={step + 3}"]
    assert subprocess.run([*cmd, "--resume", *more], capture_output=True, env=ONE_THREAD).returncode == 0
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**LRA, "train": {**train, "steps": step + 3}}))
    _, full = _subprocess_train(tmp_path, data_dir, tmp_path / "full", short)
    assert full.communicate(timeout=300)[0] is None and full.returncode == 0
    a = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(sys.platform != "linux", reason="file-size limits as a stand-in for a full disk")
def test_a_failed_checkpoint_write_is_one_line_and_leaves_a_usable_folder(tmp_path, data_dir):
    """Item 15: a full disk (here: a file-size limit) during a save: one line, exit 2, no temporary left."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, 16_000))

    out = tmp_path / "run"
    cmd, proc = _subprocess_train(tmp_path, data_dir, out, lra_config(tmp_path), preexec_fn=limit)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    line = one_line(err)
    assert "could not write" in line and "(File too large); it was not created" in line
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert subprocess.run([*cmd, "--resume"], capture_output=True, text=True).returncode == 0


def test_misleading_messages_are_fixed(tmp_path, capsys):
    """Item 16: Pathfinder's valid keys include num_samples; `recall eval` names the real missing path."""
    argv = ["lra", "generate", "--task", "pathfinder", "--out", str(tmp_path / "pf"), "--set", "data.generate.nop=1"]
    assert main(argv) == 2
    assert "'num_samples'" in one_line(capsys.readouterr().err)
    nowhere = tmp_path / "nowhere"
    assert main(["recall", "eval", "--checkpoint", str(nowhere), "--device", "cpu"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"--checkpoint {nowhere} not found" in err and "config.json" not in err


def test_empty_validation_splits_are_refused(tmp_path, data_dir, capsys):
    """Item 17: a header-only basic_val.tsv, and a Pathfinder set of under 10 images."""
    lo = tmp_path / "lo"
    listops.generate(lo, SPEC)
    (lo / "basic_val.tsv").write_text("Source\tTarget\n")
    assert lra_train(tmp_path, lo, tmp_path / "r1") == 2
    assert "basic_val.tsv holds no expressions" in one_line(capsys.readouterr().err)
    pf = tmp_path / "pf"
    pathfinder.generate(pf, pathfinder.PathfinderSpec(contour_length=6, num_distractors=0), num_samples=5)
    argv = ["lra", "train", "--task", "pathfinder", "--data", str(pf), "--out", str(tmp_path / "r2"), *QUIET]
    argv += ["--set", "data.loader={'difficulty': 'curv_baseline'}", "--set", "train.batch_size=2"]
    assert main(argv) == 2
    assert "lists 5 image(s); the 80/10/10 split needs at least 10" in one_line(capsys.readouterr().err)


def test_a_finished_run_resumed_says_so_and_changes_nothing(tmp_path, data_dir, capsys):
    """Item 18: `--resume` of a finished run appends no test row and rewrites nothing."""
    out = tmp_path / "run"
    assert lra_train(tmp_path, data_dir, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    for _ in range(2):
        assert lra_train(tmp_path, data_dir, out, "--resume") == 0
        assert "is finished (step 4): nothing to do" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
