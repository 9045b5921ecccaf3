"""Loaders for the data of every LRA task, from the files a user points to.

Every loader returns a :class:`Split` per split name ("train", "val", "test"): token
ids in an int16 tensor padded with 0 to the task length, the real lengths, the labels,
and for Retrieval a second text. Bytes and pixels are stored as value + 1, so 0 is
always padding. A missing or malformed file raises an error naming it and what was
expected.
"""

from __future__ import annotations

import csv
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import listops

SPLITS = ("train", "val", "test")


@dataclass
class Split:
    """One split: ``tokens`` (n, L) int16, 0 = padding; ``lengths`` (n,); ``labels`` (n,)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    tokens2: torch.Tensor | None = None  # Retrieval's second document
    lengths2: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, count: int) -> Split:
        """The first ``count`` samples (for quick runs)."""
        cut = slice(0, count)
        second = (None, None) if self.tokens2 is None else (self.tokens2[cut], self.lengths2[cut])
        return Split(self.tokens[cut], self.lengths[cut], self.labels[cut], *second)


@dataclass(frozen=True)
class TaskData:
    """What a model needs to know about a task, and its splits."""

    splits: dict[str, Split]
    vocab_size: int
    num_classes: int
    max_length: int
    dual: bool = False


def _pack(seqs: Sequence[Sequence[int]], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (and truncate) id sequences to ``max_length``."""
    out = np.zeros((len(seqs), max_length), dtype=np.int16)
    lengths = np.zeros(len(seqs), dtype=np.int64)
    for i, seq in enumerate(seqs):
        seq = seq[:max_length]
        out[i, : len(seq)] = seq
        lengths[i] = len(seq)
    return torch.from_numpy(out), torch.from_numpy(lengths)


def _byte_ids(text: str | bytes, max_length: int) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data[:max_length], dtype=np.uint8).astype(np.int16) + 1


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; expected {what}")
    return path


def load_listops(root: str | Path, max_length: int = 2_000) -> TaskData:
    """``basic_{train,val,test}.tsv`` (LRA release or :func:`listops.generate`) under ``root``."""
    splits = {}
    for split in SPLITS:
        path = _need(Path(root) / f"basic_{split}.tsv", "an LRA ListOps TSV with a 'Source\\tTarget' header")
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        if not rows or [c.strip() for c in rows[0][:2]] != ["Source", "Target"]:
            raise ValueError(f"{path}: the first line must be the header 'Source\\tTarget', got {rows[:1]}")
        seqs, labels = [], []
        for line, row in enumerate(rows[1:], start=2):
            try:
                if len(row) != 2:
                    raise ValueError(f"expected 2 tab-separated fields, got {len(row)}")
                label = int(row[1])
                if not 0 <= label <= 9:
                    raise ValueError(f"target must be a digit 0-9, got {label}")
                seqs.append(listops.encode(row[0]))
            except ValueError as err:
                raise ValueError(f"{path}, line {line}: {err}") from None
            labels.append(label)
        tokens, lengths = _pack(seqs, max_length)
        splits[split] = Split(tokens, lengths, torch.tensor(labels))
    return TaskData(splits, vocab_size=len(listops.VOCAB), num_classes=10, max_length=max_length)


def load_text(root: str | Path, max_length: int = 4_096) -> TaskData:
    """IMDb in its ``aclImdb`` layout (``{train,test}/{pos,neg}/*.txt``), byte-level; val is the test set (as LRA)."""
    root = Path(root)
    if (root / "aclImdb").is_dir():
        root = root / "aclImdb"
    loaded = {}
    for part in ("train", "test"):
        seqs, labels = [], []
        for label, name in ((0, "neg"), (1, "pos")):
            folder = _need(root / part / name, f"the aclImdb folder {part}/{name} of review .txt files")
            files = sorted(folder.glob("*.txt"))
            if not files:
                raise FileNotFoundError(f"{folder} holds no .txt reviews; expected the aclImdb layout")
            seqs += [_byte_ids(f.read_bytes(), max_length) for f in files]
            labels += [label] * len(files)
        loaded[part] = Split(*_pack(seqs, max_length), torch.tensor(labels))
    return TaskData({"train": loaded["train"], "val": loaded["test"], "test": loaded["test"]}, 257, 2, max_length)


RETRIEVAL_FILES = {
    "train": "new_aan_pairs.train.tsv",
    "val": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}


def load_retrieval(root: str | Path, max_length: int = 4_000) -> TaskData:
    """AAN pairs in the LRA release TSVs (``label, id1, id2, text1, text2``), byte-level."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    splits = {}
    for split, name in RETRIEVAL_FILES.items():
        path = _need(Path(root) / name, "an LRA AAN TSV with rows 'label\\tid1\\tid2\\ttext1\\ttext2'")
        first, second, labels = [], [], []
        with open(path, encoding="utf-8", newline="") as f:
            for line, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1):
                if len(row) != 5:
                    raise ValueError(f"{path}, line {line}: expected 5 tab-separated fields, got {len(row)}")
                try:
                    labels.append(int(float(row[0])))
                except ValueError:
                    raise ValueError(f"{path}, line {line}: label must be 0 or 1, got {row[0]!r}") from None
                first.append(_byte_ids(row[3], max_length))
                second.append(_byte_ids(row[4], max_length))
        tokens, lengths = _pack(first, max_length)
        tokens2, lengths2 = _pack(second, max_length)
        splits[split] = Split(tokens, lengths, torch.tensor(labels), tokens2, lengths2)
    return TaskData(splits, vocab_size=257, num_classes=2, max_length=max_length, dual=True)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data, labels = np.asarray(batch[b"data"], dtype=np.uint8), list(batch[b"labels"])
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as err:
        msg = f"{path} is not a CIFAR-10 python batch (a pickled dict with b'data', b'labels'): {err}"
        raise ValueError(msg) from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ValueError(f"{path}: b'data' must be (n, 3072) uint8 with n labels, got {data.shape}, {len(labels)}")
    return {"data": data, "labels": labels}


def load_image(root: str | Path, val_size: int = 0) -> TaskData:
    """CIFAR-10 python batches (``cifar-10-batches-py``) as grey pixel sequences of 1,024.

    Grey is ITU-R 601 luma (0.299 R + 0.587 G + 0.114 B, rounded), as ``tf.image.rgb_to_grayscale``.
    ``val_size`` > 0 holds out the last training images for validation; 0 validates on the test set (as LRA).
    """
    root = Path(root)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    parts = {}
    for part, names in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
        batches = [_unpickle(_need(root / n, "a CIFAR-10 python batch file")) for n in names]
        rgb = np.concatenate([b["data"] for b in batches]).reshape(-1, 3, 1024).astype(np.float64)
        grey = np.round(0.299 * rgb[:, 0] + 0.587 * rgb[:, 1] + 0.114 * rgb[:, 2]).astype(np.int16) + 1
        labels = torch.tensor([y for b in batches for y in b["labels"]])
        parts[part] = Split(torch.from_numpy(grey), torch.full((len(grey),), 1024), labels)
    train, test = parts["train"], parts["test"]
    if val_size:
        n = len(train) - val_size
        val = Split(train.tokens[n:], train.lengths[n:], train.labels[n:])
        train = train.subset(n)
    else:
        val = test
    return TaskData({"train": train, "val": val, "test": test}, vocab_size=257, num_classes=10, max_length=1024)


def load_pathfinder(root: str | Path, size: int = 32, difficulty: str = "curv_contour_length_14") -> TaskData:
    """Pathfinder / Path-X in the LRA release layout; split 80/10/10 in sample order.

    ``root`` is the folder holding ``pathfinder{size}/`` (or the difficulty folder itself).
    """
    from PIL import Image

    root = Path(root)
    folder = root if (root / "metadata").is_dir() else root / f"pathfinder{size}" / difficulty
    meta_dir = _need(folder / "metadata", f"the metadata folder of an LRA pathfinder{size} set")
    rows = []
    for meta in sorted(meta_dir.glob("*.npy"), key=lambda p: (len(p.stem), p.stem)):
        for line_no, line in enumerate(meta.read_text().splitlines(), start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise ValueError(f"{meta}, line {line_no}: expected 'imgs/<b> sample_<i>.png <i> <label 0|1> ...'")
            rows.append((folder / fields[0] / fields[1], int(fields[3])))
    if not rows:
        raise FileNotFoundError(f"{meta_dir} holds no metadata lines; expected LRA pathfinder metadata/*.npy files")
    pixels = np.empty((len(rows), size * size), dtype=np.int16)
    for i, (path, _) in enumerate(rows):
        with Image.open(_need(path, f"a {size}x{size} greyscale PNG listed in the metadata")) as img:
            arr = np.asarray(img.convert("L"))
        if arr.shape != (size, size):
            raise ValueError(f"{path}: expected a {size}x{size} image, got {arr.shape}")
        pixels[i] = arr.reshape(-1).astype(np.int16) + 1
    tokens, labels = torch.from_numpy(pixels), torch.tensor([label for _, label in rows])
    n = len(rows)
    cuts = [0, int(0.8 * n), int(0.9 * n), n]
    splits = {
        name: Split(tokens[a:b], torch.full((b - a,), size * size), labels[a:b])
        for name, a, b in zip(SPLITS, cuts, cuts[1:])
    }
    return TaskData(splits, vocab_size=257, num_classes=2, max_length=size * size)


LOADERS: dict[str, Callable[..., TaskData]] = {
    "listops": load_listops,
    "text": load_text,
    "retrieval": load_retrieval,
    "image": load_image,
    "pathfinder": load_pathfinder,
    "pathx": lambda root, **kw: load_pathfinder(root, **{"size": 128, **kw}),
}


def load(task: str, root: str | Path, **options) -> TaskData:
    """The data of ``task`` (one of :data:`LOADERS`) from ``root``."""
    if task not in LOADERS:
        raise ValueError(f"task must be one of {sorted(LOADERS)}, got {task!r}")
    if not Path(root).exists():
        raise FileNotFoundError(f"data folder {root} not found for task {task!r}")
    return LOADERS[task](root, **options)
