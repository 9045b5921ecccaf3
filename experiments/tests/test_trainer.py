"""The shared trainer on a toy task: config domains, schedules, data order, exact resume (workers,
EMA, accumulation, Ctrl-C), run-folder refusals, finished runs, fingerprints, strict loading."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import signal

import pytest
import torch

from mita_experiments import trainer
from mita_experiments.trainer import data as tdata
from mita_experiments.utils import checkpoint
from mita_experiments.utils.distributed import Dist

torch.manual_seed(0)
X = torch.randn(96, 6)
Y = (X[:, 0] + 0.3 * torch.randn(96) > 0).long()


class Rows:
    """Rows lo..hi of (X, Y); batched (``__getitems__``) or per sample (``__getitem__``)."""

    def __init__(self, lo: int, hi: int, batched: bool = True) -> None:
        self.lo, self.hi = lo, hi
        if not batched:
            self.__getitems__ = None

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitems__(self, indices):
        idx = torch.as_tensor(indices) + self.lo
        return X[idx] + 0.1 * torch.randn(len(idx), 6), Y[idx]  # a random "augmentation"

    def __getitem__(self, i):
        return X[i + self.lo] + 0.1 * torch.randn(6), Y[i + self.lo]


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))


def toy(batched: bool = True, workers: int = 0, **kwargs) -> trainer.Task:
    return trainer.Task(
        build_model=model,
        scores=lambda m, batch: trainer.classification_scores(m(batch[0]), batch[1]),
        train_data=Rows(0, 64, batched),
        eval_data={"val": Rows(64, 80, batched), "test": Rows(80, 96, batched)},
        identity={"model": "toy"},
        fingerprint={"train": {"size": 64}},
        workers=workers,
        **kwargs,
    )


def config(**train):
    return {"model": {"width": 16}, "train": {"batch_size": 8, "steps": 8, "lr": 0.05, "eval_every": 4, **train}}


def run(task, cfg, path, **options):
    return trainer.train(task, cfg, path, progress=False, tensorboard=False, ctx=Dist(), **options)


def weights(path, name=trainer.CHECKPOINT):
    return checkpoint.load_checkpoint(path / name)["model"]


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "step, schedule, expected",
    [
        (0, "linear", 0.25),
        (3, "linear", 1.0),
        (7, "linear", 0.5),
        (11, "linear", 0.0),
        (7, "cosine", 0.5),
        (1, "rsqrt", 0.5 / 2),
        (15, "rsqrt", 0.25),
        (9, "constant", 1.0),
    ],
    ids=["warmup", "peak", "linear-mid", "linear-end", "cosine-mid", "rsqrt-warmup", "rsqrt-decay", "constant"],
)
def test_lr_factor(step, schedule, expected):
    assert math.isclose(trainer.lr_factor(step, schedule, warmup=4, total=12), expected)


def test_lr_factor_floor_and_unknown_schedule():
    assert math.isclose(trainer.lr_factor(11, "cosine", 4, 12, floor=0.1), 0.1)
    with pytest.raises(ValueError, match=re.escape("train.schedule")):
        trainer.lr_factor(5, "step", 1, 10)


def test_step_sampler_covers_each_epoch_once_and_depends_only_on_seed_and_step():
    order = trainer.StepSampler(20, 5, seed=0)
    seen = torch.cat([order(s) for s in range(4)])
    assert sorted(seen.tolist()) == list(range(20)) and order.steps_per_epoch == 4
    assert not torch.equal(order(0), order(4))  # a new epoch, a new order
    assert torch.equal(trainer.StepSampler(20, 5, seed=0)(6), order(6))
    with pytest.raises(ValueError, match=r"train\.batch_size"):
        trainer.StepSampler(4, 8, 0)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("grad_clip", -1, "grad_clip must be a number >= 0"),
        ("lr", 0, "lr must be a positive number"),
        ("lr", float("nan"), "lr must be a positive number"),
        ("warmup", -1, "warmup must be a whole number >= 0"),
        ("steps", 0, "steps must be a whole number >= 1"),
        ("batch_size", 2.5, "batch_size must be a whole number >= 1"),
        ("accum", True, "accum must be a whole number >= 1"),
        ("weight_decay", -0.1, "weight_decay must be a number >= 0"),
        ("eval_every", 0, "eval_every must be"),
        ("checkpoint_every", -5, "checkpoint_every must be"),
        ("log_every", 0, "log_every must be"),
        ("eval_batch_size", 0, "eval_batch_size must be"),
        ("betas", [0.9, 1.0], "betas must be two numbers in"),
        ("ema", 1.0, "ema must be a decay"),
        ("min_lr", 1.0, "min_lr must be a number in"),
        ("seed", -1, "seed must be a whole number >= 0"),
        ("schedule", "cos", "schedule must be one of"),
        ("precision", "fp8", "precision must be one of"),
        ("compile", "fast", "compile must be one of"),
        ("stop_at_accuracy", 1.5, "stop_at_accuracy must be"),
        ("nope", 1, "unknown key"),
    ],
)
def test_every_train_number_is_checked_where_the_config_is_made(key, value, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        trainer.check_train({"batch_size": 8, "steps": 8, "lr": 0.1, key: value})


def test_check_train_fills_defaults_and_requires_the_essentials():
    out = trainer.check_train({"batch_size": 8, "steps": 8, "lr": 0.1, "grad_clip": 0})
    assert out["accum"] == 1 and out["grad_clip"] == 0 and out["schedule"] == "constant"
    with pytest.raises(ValueError, match="missing key"):
        trainer.check_train({"steps": 8})


@pytest.mark.parametrize(
    "batched, workers, extra",
    [(True, 0, {}), (True, 2, {"ema": 0.9, "accum": 2}), (False, 0, {"grad_clip": 0.5, "schedule": "cosine"})],
    ids=["in-process", "workers-ema-accum", "per-sample-clip-cosine"],
)
def test_stopped_and_resumed_run_is_bit_identical(tmp_path, batched, workers, extra):
    cfg = config(checkpoint_every=3, warmup=2, **extra)
    full = run(toy(batched, workers), cfg, tmp_path / "full")
    assert full["finished"] and full["step"] == 8 and {"test_accuracy_last", "best_val_accuracy"} <= set(full)
    assert not run(toy(batched, workers), cfg, tmp_path / "part", stop_after=5)["finished"]
    run(toy(batched, workers), cfg, tmp_path / "part", resume=True)
    assert same(weights(tmp_path / "full"), weights(tmp_path / "part"))
    full_rows = (tmp_path / "full" / trainer.METRICS).read_text()
    assert (tmp_path / "part" / trainer.METRICS).read_text().splitlines()[1:] != []
    assert [r.split(",")[:3] for r in full_rows.splitlines()] == [
        r.split(",")[:3] for r in (tmp_path / "part" / trainer.METRICS).read_text().splitlines()
    ]
    lines = (tmp_path / "part" / trainer.METRICS_JSONL).read_text().splitlines()
    assert [json.loads(x)["split"] for x in lines].count("test") == 1


def test_worker_processes_give_the_same_run_as_in_process_loading(tmp_path):
    run(toy(workers=0), config(), tmp_path / "zero")
    run(toy(workers=2), config(), tmp_path / "two")
    assert same(weights(tmp_path / "zero"), weights(tmp_path / "two"))


def test_ctrl_c_stops_at_the_step_with_a_checkpoint_and_resumes_exactly(tmp_path):
    """Issue 25 item 15: KeyboardInterrupt during training saves a checkpoint first; the SIGINT
    handler is restored to what it was (the default, or ignored in a job started in the background)."""
    calls = {"n": 0}
    handler = signal.getsignal(signal.SIGINT)

    def scores(m, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return trainer.classification_scores(m(batch[0]), batch[1])

    task = toy()
    task.scores = scores
    with pytest.raises(trainer.Interrupted, match="interrupted at step 3"):
        run(task, config(), tmp_path / "part")
    assert checkpoint.load_checkpoint(tmp_path / "part" / trainer.CHECKPOINT)["step"] == 3
    assert signal.getsignal(signal.SIGINT) is handler
    run(toy(), config(), tmp_path / "part", resume=True)
    run(toy(), config(), tmp_path / "full")
    assert same(weights(tmp_path / "full"), weights(tmp_path / "part"))


def test_a_finished_run_resumed_changes_nothing(tmp_path):
    """Issue 25 item 18: resuming a finished run says so and appends nothing."""
    path = tmp_path / "run"
    summary = run(toy(), config(), path)
    before = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    assert run(toy(), config(), path, resume=True) == summary
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()} == before
    longer = run(toy(), config(steps=12), path, resume=True)
    assert longer["step"] == 12 and longer["finished"]
    rows = [json.loads(x) for x in (path / trainer.METRICS_JSONL).read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "test"] == [8, 12]


def test_compiled_training_forward_matches_eager_and_resumes_either_way(tmp_path, monkeypatch):
    """train.compile: the step runs through torch.compile (inductor) and trains the weights eager would
    (a model without dropout: inductor draws its own random masks); a run may resume with it on or off."""
    modes, real_compile = [], torch.compile

    def spy(module, **kwargs):
        modes.append(kwargs.get("mode"))
        return real_compile(module, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)

    def task():
        return trainer.Task(
            build_model=lambda: torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)),
            scores=lambda m, batch: trainer.classification_scores(m(batch[0]), batch[1]),
            train_data=Rows(0, 64),
            eval_data={"val": Rows(64, 80)},
        )

    eager = run(task(), config(), tmp_path / "eager")
    assert modes == []
    compiled = run(task(), config(compile="default"), tmp_path / "compiled")
    assert compiled["finished"] and compiled["step"] == eager["step"] and modes == ["default"]
    for key, value in weights(tmp_path / "eager").items():
        torch.testing.assert_close(weights(tmp_path / "compiled")[key], value, rtol=1e-5, atol=1e-6)
    run(task(), config(compile="default"), tmp_path / "switch", stop_after=4)
    assert run(task(), config(), tmp_path / "switch", resume=True)["finished"]
    torch.testing.assert_close(weights(tmp_path / "switch")["0.weight"], weights(tmp_path / "eager")["0.weight"])


def test_run_folder_refusals_force_and_stale_temporaries(tmp_path):
    path = tmp_path / "run"
    run(toy(), config(steps=2), path)
    with pytest.raises(FileExistsError, match="--resume to continue it, --force to start it over"):
        run(toy(), config(steps=2), path)
    with pytest.raises(ValueError, match="give one of them"):
        run(toy(), config(steps=2), path, resume=True, force=True)
    (path / "notes.txt").write_text("mine")
    assert run(toy(), config(steps=3), path, force=True)["step"] == 3
    assert (path / "notes.txt").read_text() == "mine"
    killed = tmp_path / "killed"  # a kill -9 during the first save
    killed.mkdir()
    (killed / ".checkpoint.pt.k2j4_x9.tmp").write_bytes(b"half a checkpoint")
    assert run(toy(), config(steps=2), killed, resume=True)["finished"]
    assert not list(killed.glob("*.tmp")) and not list(killed.glob(".*.tmp"))


def test_a_second_process_cannot_write_the_same_run(tmp_path):
    from mita_experiments.utils.files import lock_folder

    (tmp_path / "run").mkdir()
    with lock_folder(tmp_path / "run"), pytest.raises(BlockingIOError, match="another process"):
        run(toy(), config(steps=2), tmp_path / "run")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t, c: setattr(t, "identity", {"model": "other"}), "the model cannot change on resume"),
        (lambda t, c: setattr(t, "fingerprint", {"train": {"size": 65}}), r"not the data .*train.size \(64 -> 65\)"),
        (lambda t, c: c["model"].update(width=32), "--resume cannot change model.width"),
        (lambda t, c: c["train"].update(lr=0.1), "--resume cannot change train.lr"),
    ],
    ids=["identity", "data", "model", "lr"],
)
def test_resume_refuses_what_may_not_change(tmp_path, change, match):
    run(toy(), config(), tmp_path / "run", stop_after=2)
    task, cfg = toy(), config()
    change(task, cfg)
    with pytest.raises(ValueError, match=match):
        run(task, cfg, tmp_path / "run", resume=True)


def test_resume_with_another_number_of_processes_is_refused(tmp_path):
    """Issue 25 item 12: the world size is checked (in one process here; the DDP test does it for real)."""
    run(toy(), config(), tmp_path / "run", stop_after=2)
    state = checkpoint.load_checkpoint(tmp_path / "run" / trainer.CHECKPOINT)
    checkpoint.save_checkpoint({**state, "world_size": 2}, tmp_path / "run" / trainer.CHECKPOINT)
    with pytest.raises(ValueError, match=r"trained by 2 process\(es\) and this is 1.*--nproc_per_node 2"):
        run(toy(), config(), tmp_path / "run", resume=True)


def test_empty_evaluation_split_is_refused(tmp_path):
    task = toy()
    task.eval_data = {"val": Rows(64, 64), "test": Rows(80, 96)}
    with pytest.raises(ValueError, match="the val split is empty"):
        run(task, config(), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_non_finite_loss_stops_with_one_message(tmp_path):
    task = toy()
    task.scores = lambda m, batch: trainer.Scores(m(batch[0]).sum() * float("nan"), len(batch[1]), {"accuracy": 0})
    with pytest.raises(ValueError, match="the training loss is nan at step 1"):
        run(task, config(), tmp_path / "run")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a file descriptor's file through /proc")
def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """Issue 25 item 15: a failed write is one OSError naming the file; the data is intact."""
    path = tmp_path / "run"
    run(toy(), config(checkpoint_every=2), path, stop_after=2)
    good = (path / trainer.CHECKPOINT).read_bytes()
    real = os.fsync

    def full(fd):
        if ".checkpoint.pt." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"could not write .*checkpoint.pt \(No space left on device\); it was left"):
        run(toy(), config(checkpoint_every=2), path, resume=True)
    monkeypatch.setattr(os, "fsync", real)
    assert (path / trainer.CHECKPOINT).read_bytes() == good
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]
    assert run(toy(), config(checkpoint_every=2), path, resume=True)["finished"]


def test_strict_loading_names_missing_unexpected_and_shapes(tmp_path):
    m = model()
    state = dict(m.state_dict())
    state.pop("0.bias")
    state["2.extra"] = torch.zeros(1)
    state["2.weight"] = torch.zeros(3, 16)
    with pytest.raises(ValueError, match=r"missing keys: 0.bias; unexpected keys: 2.extra; other shapes: 2.weight"):
        trainer.load_model_state(m, state, "x.pt")


def test_checkpoint_readers(tmp_path):
    run(toy(), config(steps=2), tmp_path / "run")
    assert trainer.resolve_checkpoint(tmp_path / "run").name == trainer.BEST
    state = trainer.read_checkpoint(tmp_path / "run" / trainer.WEIGHTS)
    assert state["identity"] == {"model": "toy"} and state["config"]["train"]["steps"] == 2
    with pytest.raises(FileNotFoundError, match=re.escape(f"--checkpoint {tmp_path / 'nowhere'} not found")):
        trainer.resolve_checkpoint(tmp_path / "nowhere")
    checkpoint.save_checkpoint({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a checkpoint of this trainer"):
        trainer.read_checkpoint(tmp_path / "other.pt")
    assert trainer.read_manifest(tmp_path / "run")["identity"] == {"model": "toy"}


def test_data_fingerprint_digest():
    a = torch.arange(6, dtype=torch.int16)
    assert trainer.tensor_digest(a) == trainer.tensor_digest(a.clone())
    assert trainer.tensor_digest(a) != trainer.tensor_digest(a.to(torch.int32))
    assert trainer.tensor_digest(a, None) != trainer.tensor_digest(a)
    assert tdata.derive_seed(1, 2) != tdata.derive_seed(2, 1)
