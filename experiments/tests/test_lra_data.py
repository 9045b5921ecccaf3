"""LRA data: the ListOps and Pathfinder generators and the loaders of every task's file format."""

from __future__ import annotations

import hashlib
import pickle
import random
import re

import numpy as np
import pytest
import torch
from PIL import Image

from mita_experiments.lra.data import listops, loaders, pathfinder

TINY = listops.ListOpsSpec(num_train=30, num_val=5, num_test=5, min_length=10, max_length=60, max_depth=4, seed=3)


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("listops")
    listops.generate(out, TINY)
    return out


def test_listops_files_are_reproducible(listops_dir, tmp_path):
    listops.generate(tmp_path, TINY)
    for split in listops.SPLITS:
        name = f"basic_{split}.tsv"
        assert (tmp_path / name).read_bytes() == (listops_dir / name).read_bytes()
    # Python's Mersenne Twister is the same on every machine: pin the bytes of one file.
    digest = hashlib.sha256((listops_dir / "basic_val.tsv").read_bytes()).hexdigest()
    assert digest == LISTOPS_VAL_SHA256


def test_listops_rows_follow_the_definition(listops_dir):
    sources = []
    for split, count in (("train", 30), ("val", 5), ("test", 5)):
        lines = (listops_dir / f"basic_{split}.tsv").read_text().splitlines()
        assert lines[0] == "Source\tTarget"
        assert len(lines) == count + 1
        for line in lines[1:]:
            source, target = line.split("\t")
            tokens = listops.tokenize(source)
            assert TINY.min_length <= len(tokens) <= TINY.max_length
            assert listops.evaluate(source) == int(target)
            assert tokens.count("X") == sum(t in listops.OPERATORS for t in tokens)  # one ] per operator
            sources.append(source)
    assert len(set(sources)) == len(sources)  # de-duplicated across all splits


@pytest.mark.parametrize(
    "source, value",
    [
        ("( ( ( [MAX 2 ) 9 ) ] )", 9),
        ("( ( ( [MIN 4 ) 7 ) ] )", 4),
        ("( ( ( ( ( [MED 1 ) 2 ) 5 ) 9 ) ] )", 3),  # int of the median 3.5
        ("( ( ( ( [SM 7 ) 8 ) 9 ) ] )", 4),
        ("( ( ( [MAX 2 ) ( ( ( [MIN 4 ) 7 ) ] ) ) ] )", 4),
    ],
    ids=["max", "min", "median-even", "sum-mod-10", "nested"],
)
def test_listops_operators(source, value):
    assert listops.evaluate(source) == value


def test_listops_tokenizer_keeps_the_closing_bracket():
    assert listops.tokenize("( ( ( [MAX 2 ) 9 ) ] )") == ["[MAX", "2", "9", "X"]
    ids = listops.encode("( ( ( [MAX 2 ) 9 ) ] )")
    assert ids[-1] == listops.TOKEN_IDS["X"] and 0 not in ids
    with pytest.raises(ValueError, match="unknown ListOps token"):
        listops.encode("[MAX 2 foo ]")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_train": -1}, "num_train"),
        ({"min_length": 50, "max_length": 10}, "min_length"),
        ({"max_args": 1}, "max_args"),
        ({"leaf_prob": 1.0}, "leaf_prob"),
    ],
    ids=["negative-count", "empty-window", "arity", "leaf-prob"],
)
def test_listops_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        listops.ListOpsSpec(**kwargs)


def test_listops_generate_refuses_to_overwrite(listops_dir):
    with pytest.raises(FileExistsError, match="overwrite"):
        listops.generate(listops_dir, TINY)


def test_listops_loader(listops_dir):
    data = loaders.load("listops", listops_dir, max_length=40)
    train = data.splits["train"]
    assert train.tokens.shape == (30, 40) and train.tokens.dtype == torch.int16
    first = (listops_dir / "basic_train.tsv").read_text().splitlines()[1].split("\t")
    ids = listops.encode(first[0])[:40]
    assert train.tokens[0, : len(ids)].tolist() == ids and int(train.lengths[0]) == len(ids)
    assert int(train.labels[0]) == int(first[1])
    assert data.vocab_size == len(listops.VOCAB) and data.num_classes == 10


@pytest.mark.parametrize(
    "content, match",
    [
        ("Text\tLabel\n( [MAX 1 ] )\t1\n", "header"),
        ("Source\tTarget\n( ( [MAX 1 ) ] )\t12\n", "line 2"),
        ("Source\tTarget\n( ( [MAX 1 ) ] )\n", "2 tab-separated"),
    ],
    ids=["bad-header", "bad-target", "missing-field"],
)
def test_listops_loader_errors(tmp_path, content, match):
    for split in loaders.SPLITS:
        (tmp_path / f"basic_{split}.tsv").write_text(content)
    with pytest.raises(ValueError, match=match):
        loaders.load_listops(tmp_path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("basic_train.tsv")):
        loaders.load_listops(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found for task"):
        loaders.load("listops", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="task must be one of"):
        loaders.load("chess", tmp_path)


SMALL_PF = pathfinder.PathfinderSpec(num_distractors=1, contour_length=6, seed=1)


def test_pathfinder_render_is_seeded_and_antialiased():
    images = pathfinder.render(SMALL_PF, 7, [1, 0, 1])
    assert images.shape == (3, 32, 32) and images.dtype == np.uint8
    assert np.array_equal(images, pathfinder.render(SMALL_PF, 7, [1, 0, 1]))
    assert not np.array_equal(images, pathfinder.render(SMALL_PF, 8, [1, 0, 1]))
    values = np.unique(images[0])
    assert values[0] == 0 and values[-1] == 255 and ((values > 0) & (values < 255)).any()  # anti-aliased edges
    with pytest.raises(ValueError, match="labels"):
        pathfinder.render(SMALL_PF, 0, [2])


def test_pathfinder_contours_are_separate_walks_of_equal_steps():
    canvases = pathfinder._Canvases(SMALL_PF, np.random.default_rng(0), 4)
    rows = np.arange(4)
    first, found = canvases.contours(rows)
    assert found.all() and first.shape == (4, SMALL_PF.contour_length + 1)
    assert np.allclose(np.abs(np.diff(first, axis=1)), SMALL_PF.paddle_step)
    canvases.draw(rows, first)
    second, found = canvases.contours(rows)
    for a, b in zip(first[found], second[found]):  # vertices of two contours keep the clearance apart
        assert np.abs(a[:, None] - b[None, :]).min() > SMALL_PF.clearance


def test_pathfinder_labels_are_balanced_and_seeded():
    labels = pathfinder.labels_for_range(0, 0, 100)
    assert sum(labels) == 50
    assert labels[10:20] == pathfinder.labels_for_range(0, 10, 20)
    assert labels != pathfinder.labels_for_range(1, 0, 100)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"size": 48}, "size"), ({"contour_length": 1}, "contour_length"), ({"paddle_fraction": 0.0}, "paddle_fraction")],
    ids=["size", "length", "fraction"],
)
def test_pathfinder_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pathfinder.PathfinderSpec(**kwargs)


@pytest.fixture(scope="module")
def pathfinder_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pf")
    pathfinder.generate(out, SMALL_PF, num_samples=30, per_folder=12)
    return out


def test_pathfinder_layout_and_loader(pathfinder_dir, tmp_path):
    root = pathfinder_dir / "pathfinder32" / "curv_baseline"
    assert sorted(p.name for p in (root / "metadata").iterdir()) == ["0.npy", "1.npy", "2.npy"]
    line = (root / "metadata" / "1.npy").read_text().splitlines()[0].split()
    assert line[:3] == ["imgs/1", "sample_12.png", "12"]
    img = np.asarray(Image.open(root / line[0] / line[1]))
    chunk = pathfinder.render(SMALL_PF, 12, pathfinder.labels_for_range(SMALL_PF.seed, 12, 24))
    assert np.array_equal(img, chunk[0]) and line[3] == str(pathfinder.labels_for_range(SMALL_PF.seed, 12, 13)[0])
    data = loaders.load("pathfinder", pathfinder_dir, difficulty="curv_baseline")
    sizes = [len(data.splits[s]) for s in loaders.SPLITS]
    assert sizes == [24, 3, 3] and data.splits["train"].tokens.shape == (24, 1024)
    assert int(data.splits["train"].tokens.min()) >= 1  # pixels are stored as value + 1
    with pytest.raises(FileExistsError, match="overwrite"):
        pathfinder.generate(pathfinder_dir, SMALL_PF, num_samples=4)
    grid = pathfinder.example_grid(tmp_path / "grid.png", SMALL_PF, count=4, cols=2, zoom=1)
    assert Image.open(grid).size == (2 * 36, 2 * 36)


def test_pathfinder_loader_errors(pathfinder_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="metadata"):
        loaders.load_pathfinder(tmp_path)
    meta = tmp_path / "metadata"
    meta.mkdir()
    (meta / "0.npy").write_text("imgs/0 sample_0.png 0 1\n")
    with pytest.raises(FileNotFoundError, match=re.escape("sample_0.png")):
        loaders.load_pathfinder(tmp_path)
    (meta / "0.npy").write_text("imgs/0 sample_0.png 0 yes\n")
    with pytest.raises(ValueError, match=re.escape("label 0|1")):
        loaders.load_pathfinder(tmp_path)


def _imdb(root, per_class=2):
    for part in ("train", "test"):
        for name in ("pos", "neg"):
            folder = root / "aclImdb" / part / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                (folder / f"{i}_7.txt").write_text(f"{name} review {i} é" * (i + 1))


def test_text_loader_reads_aclimdb_bytes(tmp_path):
    _imdb(tmp_path)
    data = loaders.load("text", tmp_path, max_length=16)
    train = data.splits["train"]
    assert train.labels.tolist() == [0, 0, 1, 1]
    raw = "neg review 0 é".encode()
    assert train.tokens[0, : len(raw)].tolist() == [b + 1 for b in raw] and int(train.lengths[0]) == len(raw)
    assert int(train.lengths[1]) == 16  # truncated
    assert data.splits["val"] is data.splits["test"]


def test_text_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train/neg"):
        loaders.load_text(tmp_path)
    _imdb(tmp_path)
    for f in (tmp_path / "aclImdb" / "test" / "pos").iterdir():
        f.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("no .txt")):
        loaders.load_text(tmp_path)


def test_retrieval_loader_reads_aan_pairs(tmp_path):
    for name in loaders.RETRIEVAL_FILES.values():
        (tmp_path / name).write_text("1\tp1\tp2\tabc\tdefg\n0.0\tp3\tp4\txy\tz\n")
    data = loaders.load("retrieval", tmp_path, max_length=8)
    train = data.splits["train"]
    assert data.dual and train.labels.tolist() == [1, 0]
    assert train.tokens[0, :3].tolist() == [ord(c) + 1 for c in "abc"]
    assert train.tokens2[0, :4].tolist() == [ord(c) + 1 for c in "defg"] and train.lengths2.tolist() == [4, 1]
    (tmp_path / "new_aan_pairs.eval.tsv").write_text("1\tp1\tabc\n")
    with pytest.raises(ValueError, match=r"eval.tsv, line 1: expected 5"):
        loaders.load_retrieval(tmp_path)


def _cifar(root, n=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = {}
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(range(n))}
        (folder / name).write_bytes(pickle.dumps(batch))
        batches[name] = batch
    return batches


def test_image_loader_makes_grey_sequences(tmp_path):
    batches = _cifar(tmp_path)
    data = loaders.load("image", tmp_path, val_size=4)
    assert [len(data.splits[s]) for s in loaders.SPLITS] == [16, 4, 4]
    rgb = batches["data_batch_1"][b"data"][0].reshape(3, 1024).astype(float)
    grey = np.round(0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]) + 1
    assert data.splits["train"].tokens[0].tolist() == grey.astype(int).tolist()
    assert data.splits["val"].labels.tolist() == batches["data_batch_5"][b"labels"]


def test_image_loader_errors(tmp_path):
    _cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR-10 python batch"):
        loaders.load_image(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        loaders.load_image(tmp_path)


@pytest.mark.parametrize("label", [True, 3.0], ids=["bool", "float"])
def test_cifar_labels_must_be_ints(tmp_path, label):
    """Issue 25 item 18: a bool label (an int subclass) was accepted."""
    _cifar(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    batch = pickle.loads(path.read_bytes())
    batch[b"labels"][0] = label
    path.write_bytes(pickle.dumps(batch))
    with pytest.raises(ValueError, match=r"data_batch_2 is not a CIFAR-10 python batch.*ints 0-9"):
        loaders.load_image(tmp_path)


def test_loader_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"data\.loader\.size: task 'listops' takes no such option"):
        loaders.load("listops", tmp_path, size=32)
    with pytest.raises(ValueError, match=r"data\.loader\.max_length must be a whole number >= 1, got -1"):
        loaders.load("listops", tmp_path, max_length=-1)


def test_listops_draws_use_only_python_random():
    """The generator's stream is Python's seeded Mersenne Twister (portable), not global state."""
    random.seed(123)
    a = list(listops.samples(TINY, 3, random.Random(9), set()))
    random.seed(456)
    assert a == list(listops.samples(TINY, 3, random.Random(9), set()))


LISTOPS_VAL_SHA256 = "f714c77ec0e7e47937421c0760968cfa1047da3fbb67346374615851cc56c136"


# --- hostile and careless files (issue 12: items 9, 10, 11, 18) ------------------------------


class _Payload:
    """Unpickling this calls ``pathlib.Path.touch`` on ``marker``: code run by a data file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib

        return pathlib.Path(self.marker).touch, ()


def test_cifar_batch_with_a_code_payload_is_refused_without_running_it(tmp_path):
    _cifar(tmp_path)
    marker = tmp_path / "payload-ran"
    evil = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3], b"x": _Payload(marker)}
    for protocol in (2, 4, 5):
        (tmp_path / "cifar-10-batches-py" / "data_batch_2").write_bytes(pickle.dumps(evil, protocol=protocol))
        with pytest.raises(ValueError, match=r"data_batch_2 is not a CIFAR-10 python batch.*refused"):
            loaders.load_image(tmp_path)
        assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_batches_of_every_pickle_protocol_load(tmp_path, protocol):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar(tmp_path)
    batch = {
        b"batch_label": b"training batch 1 of 5",
        b"data": np.full((4, 3072), 7, np.uint8),
        b"labels": [9, 8, 7, 6],
        b"filenames": [b"a.png", b"b.png", b"c.png", b"d.png"],
    }
    (folder / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=protocol))
    data = loaders.load_image(tmp_path)
    assert data.splits["train"].labels[:4].tolist() == [9, 8, 7, 6]
    assert int(data.splits["train"].tokens[0, 0]) == 8


def _pathfinder_set(root, lines):
    (root / "metadata").mkdir(parents=True)
    (root / "imgs" / "0").mkdir(parents=True)
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(root / "imgs" / "0" / "sample_0.png")
    (root / "metadata" / "0.npy").write_text("".join(f"{line}\n" for line in lines))


@pytest.mark.parametrize(
    "entry", ["imgs/0 ../../../secret.png", "/etc passwd", "imgs ../../outside.png"], ids=["dotdot", "abs", "up2"]
)
def test_pathfinder_metadata_cannot_leave_the_data_folder(tmp_path, entry):
    root = tmp_path / "data" / "set"
    _pathfinder_set(root, ["imgs/0 sample_0.png 0 1", f"{entry} 1 0"])
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(tmp_path / "data" / "outside.png")
    with pytest.raises(ValueError, match="lies outside the data folder"):
        loaders.load_pathfinder(root)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_pathfinder_fifo_is_refused_not_waited_on(tmp_path):
    import os

    root = tmp_path / "set"
    _pathfinder_set(root, ["imgs/0 sample_0.png 0 1", "imgs/0 pipe.png 1 0"])
    os.mkfifo(root / "imgs" / "0" / "pipe.png")
    with pytest.raises(ValueError, match=r"pipe.png is not a regular file"):
        loaders.load_pathfinder(root)
    (root / "metadata" / "0.npy").unlink()
    os.mkfifo(root / "metadata" / "0.npy")
    with pytest.raises(ValueError, match=r"0.npy is not a regular file"):
        loaders.load_pathfinder(root)


def test_corrupt_png_and_binary_metadata_are_named(tmp_path):
    root = tmp_path / "set"
    _pathfinder_set(root, ["imgs/0 sample_0.png 0 1"])
    png = root / "imgs" / "0" / "sample_0.png"
    png.write_bytes(png.read_bytes()[:40])  # truncated
    with pytest.raises(ValueError, match=r"sample_0.png is not a readable image"):
        loaders.load_pathfinder(root)
    (root / "metadata" / "0.npy").write_bytes(np.lib.format.magic(1, 0) + b"\x00\x01binary")
    with pytest.raises(ValueError, match=r"0.npy is a binary file"):
        loaders.load_pathfinder(root)


def test_non_utf8_listops_is_named(tmp_path):
    for split in loaders.SPLITS:
        (tmp_path / f"basic_{split}.tsv").write_bytes(b"Source\tTarget\n( [MAX 1 \xff ] )\t1\n")
    with pytest.raises(ValueError, match=r"basic_train.tsv is not UTF-8 text \(byte 0xff at offset 23\)"):
        loaders.load_listops(tmp_path)


def test_listops_header_with_a_byte_order_mark_and_a_long_line(tmp_path):
    long_source = " ".join(["( [MAX", *["1"] * 70_000, "] )"])  # one field over 128 KiB
    for split in loaders.SPLITS:
        (tmp_path / f"basic_{split}.tsv").write_text(f"\ufeffSource\tTarget\n{long_source}\t1\n", encoding="utf-8")
    assert len(long_source) > 128 * 1024
    data = loaders.load_listops(tmp_path, max_length=8)
    assert data.splits["train"].labels.tolist() == [1] and int(data.splits["train"].lengths[0]) == 8


@pytest.mark.parametrize("label", ["7", "-1", "0.9", "yes", "", "1e0", "true"])
def test_retrieval_labels_must_be_zero_or_one(tmp_path, label):
    """Issue 25 item 18: labels are integers 0 or 1 ("1e0" was accepted)."""
    for name in loaders.RETRIEVAL_FILES.values():
        (tmp_path / name).write_text(f"1\tp1\tp2\tabc\tdefg\n{label}\tp3\tp4\txy\tz\n")
    with pytest.raises(ValueError, match=r"train.tsv, line 2: label must be 0 or 1"):
        loaders.load_retrieval(tmp_path)


def test_retrieval_reads_a_document_over_128_kib(tmp_path):
    big = "x" * (200 * 1024)
    for name in loaders.RETRIEVAL_FILES.values():
        (tmp_path / name).write_text(f"1.0\tp1\tp2\t{big}\tdefg\n")
    data = loaders.load_retrieval(tmp_path, max_length=8)
    assert data.splits["train"].labels.tolist() == [1] and int(data.splits["train"].lengths[0]) == 8
