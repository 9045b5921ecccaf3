"""mita_experiments.utils and mita.utils: options, output guards, atomic saves, checkpoints, flags, devices."""

from __future__ import annotations

import os

import pytest
import torch

from mita.utils import options
from mita_experiments.cli import main
from mita_experiments.utils import checkpoint, files


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return pathlib.Path(self.marker).touch, ()


def test_crafted_checkpoint_is_refused_without_running_code(tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    torch.save({"model": {}, "x": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="refused without running them"):
        checkpoint.load_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()
    data = tmp_path / "data"
    data.mkdir()
    args = ["lra", "eval", "--task", "listops", "--data", str(data), "--checkpoint", str(tmp_path / "evil.pt")]
    assert main(args) == 2
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04garbage", None], ids=["empty", "corrupt", "truncated"])
def test_bad_checkpoints_are_named(tmp_path, content):
    path = tmp_path / "c.pt"
    if content is None:
        checkpoint.save_checkpoint({"w": torch.ones(1000)}, path)
        content = path.read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"c.pt is (empty|truncated or corrupt)"):
        checkpoint.load_checkpoint(path)


def test_save_refuses_objects_and_fsyncs(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="only tensors and plain types"):
        checkpoint.save_checkpoint({"x": object()}, tmp_path / "a.pt")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    checkpoint.save_checkpoint({"w": torch.ones(2), "step": 3}, tmp_path / "a.pt")
    assert len(synced) >= 2  # the file, then its folder
    assert checkpoint.load_checkpoint(tmp_path / "a.pt")["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temporary left


def test_output_guard(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        files.prepare_output_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="is a file, so nothing"):
        files.prepare_output_dir(tmp_path / "file" / "sub")
    with pytest.raises(FileExistsError, match="not empty"):
        files.prepare_output_dir(tmp_path)
    assert files.prepare_output_dir(tmp_path, force=True) == tmp_path
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            files.prepare_output_dir(locked / "out")


@pytest.mark.parametrize(
    "args",
    [
        ["vision", "flops", "--out", "{file}/sub"],
        ["lra", "eval", "--task", "listops", "--data", "d", "--checkpoint", "c", "--out", "{file}/x.json"],
        ["bench", "--quick", "--out", "{file}"],
    ],
    ids=["vision-flops", "lra-eval", "bench"],
)
def test_out_under_a_file_fails_before_any_work(tmp_path, capsys, args):
    (tmp_path / "f").write_text("x")
    assert main([a.replace("{file}", str(tmp_path / "f")) for a in args]) == 2
    assert "is a file" in capsys.readouterr().err


def test_options_nested_typed_and_duplicates():
    assert options.parse_assignments(["a.b.c=2", "d=(1, 2)", "e=x"]) == {"a.b.c": 2, "d": (1, 2), "e": "x"}
    with pytest.raises(ValueError, match="given twice"):
        options.parse_assignments(["k=1", "k=2"])
    with pytest.raises(ValueError, match="given twice"):
        options.parse_config("mita:topk=1,topk=2")
    config = {"data": {"generate": {"num_train": 5}}}
    assert options.apply_assignments(config, {"data.generate.num_train": 2000})["data"]["generate"]["num_train"] == 2000
    with pytest.raises(ValueError, match="unknown key 'nope'"):
        options.apply_assignments(config, {"data.nope": 1})


@pytest.mark.parametrize(
    "argv",
    [
        ["lra", "eval", "--task", "listops", "--data", "d", "--checkpoint", "c", "--overwrite"],
        ["lra", "train", "--task", "listops", "--data", "d", "--out", "o", "--run-dir", "r"],
        ["recall", "generate", "--out", "o", "--overwrite"],
    ],
    ids=["lra-overwrite", "lra-run-dir", "recall-overwrite"],
)
def test_old_flag_spellings_are_gone(argv, capsys):
    from mita_experiments.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_nested_set_reaches_the_generator(tmp_path):
    """``--set data.generate.num_train=...`` (a nested key) through ``mita lra generate``."""
    out = tmp_path / "listops"
    argv = ["lra", "generate", "--task", "listops", "--out", str(out), "--set", "data.generate.num_train=7"]
    argv += ["--set", "data.generate.num_val=3", "--set", "data.generate.num_test=3"]
    assert main(argv) == 0
    train = next(p for p in out.rglob("*train*") if p.is_file())
    assert sum(1 for _ in train.open()) - 1 == 7  # a header, then one line per sample


def test_numbers_below_one_are_refused_at_parse_time(capsys):
    from mita_experiments.lra.config import load_config

    for key in ("batch_size", "accum", "checkpoint_every", "eval_batch_size", "steps"):
        with pytest.raises(ValueError, match=f"train.{key} must be"):
            load_config("listops", "cpu", [f"train.{key}=0"])
    with pytest.raises(SystemExit):
        main(["lra", "eval", "--task", "listops", "--data", "d", "--checkpoint", "c", "--batch-size", "0"])


def test_null_in_a_message_is_a_value_set_accepts(tmp_path, capsys):
    """Issue 25 item 16: messages say "or null"; --set takes null (and None) for it."""
    assert options.parse_value("null") is None and options.parse_value("None") is None
    assert options.parse_value("true") is True and options.parse_value("'null'") == "null"
    from mita_experiments.trainer.config import check_train

    train = {"steps": 2, "batch_size": 2, "lr": 1e-3, "grad_clip": options.parse_value("null")}
    assert check_train(train)["grad_clip"] is None


def test_memory_setup_names_the_allocator_settings(monkeypatch):
    """Benchmarks record the allocator settings that move CPU timings (fresh pages per call)."""
    from mita_experiments.utils import machine

    for name in machine.MEMORY_ENV:
        monkeypatch.delenv(name, raising=False)
    assert machine.memory_setup().startswith("default allocator")
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libjemalloc.so.2:/usr/lib/libfoo.so")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=4294967296")
    monkeypatch.setenv("MITA_CPU_CACHE_MB", "0")
    line = machine.memory_setup()
    assert line.startswith("MITA_CPU_CACHE_MB=0, LD_PRELOAD=libjemalloc.so.2 libfoo.so, GLIBC_TUNABLES=glibc.malloc.")
    assert "/opt/lib" not in line and "default" not in line
    assert machine.machine_info()["memory"] == line and line in machine.describe()
