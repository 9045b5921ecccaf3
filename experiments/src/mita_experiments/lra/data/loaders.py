"""Loaders for the data of every LRA task, from the files a user points to.

Every loader returns a :class:`Split` per split name ("train", "val", "test"): token
ids in an int16 tensor padded with 0 to the task length, the real lengths, the labels,
and for Retrieval a second text. Bytes and pixels are stored as value + 1, so 0 is
always padding. A missing or malformed file raises an error naming it and what was
expected. Nothing is read from outside the folder given (Pathfinder's metadata may not
point elsewhere), only regular files are opened (a FIFO never blocks a load), and the
CIFAR-10 batches are unpickled admitting only the types of their format.
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
import pickle
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...trainer.data import tensor_digest
from . import listops

SPLITS = ("train", "val", "test")
#: what a model needs to know about a task's data
META = ("vocab_size", "num_classes", "max_length", "dual")


@dataclass
class Split:
    """One split: ``tokens`` (n, L) int16, 0 = padding; ``lengths`` (n,); ``labels`` (n,), or
    (n, L) per-token labels; for Retrieval the second documents ``tokens2`` and ``lengths2``.

    It is a dataset of the trainer (:mod:`mita_experiments.trainer`): ``split.__getitems__(indices)``
    is the batch of those samples.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    tokens2: torch.Tensor | None = None  # Retrieval's second document
    lengths2: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: Sequence[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The inputs ([tokens] or [tokens, tokens2], int16, trimmed to the longest real sequence)
        and the labels of the samples ``indices``."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        width = max(1, int(self.lengths[idx].max()))
        inputs = [self.tokens[idx, :width]]
        if self.tokens2 is not None:
            inputs.append(self.tokens2[idx, : max(1, int(self.lengths2[idx].max()))])
        labels = self.labels[idx]
        return inputs, labels[:, :width] if labels.dim() == 2 else labels

    def fingerprint(self) -> dict[str, Any]:
        """The split's size and a SHA-256 of its contents (what a resumed run checks)."""
        digest = tensor_digest(self.tokens, self.lengths, self.labels, self.tokens2, self.lengths2)
        return {"size": len(self), "sha256": digest}

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

    @property
    def meta(self) -> dict[str, Any]:
        """{vocab_size, num_classes, max_length, dual}: what the model is built for."""
        return {k: getattr(self, k) for k in META}

    def fingerprint(self) -> dict[str, Any]:
        """:attr:`meta` and each split's size and content hash."""
        return {**self.meta, "splits": {name: split.fingerprint() for name, split in self.splits.items()}}


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


def _need(path: Path, what: str, folder: bool = False) -> Path:
    """``path`` if it is an existing regular file (or folder); else an error naming it and ``what``."""
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; expected {what}")
    if not (path.is_dir() if folder else path.is_file()):
        kind = "folder" if folder else "regular file"
        raise ValueError(f"{path} is not a {kind}; expected {what}")
    return path


def _read_text(path: Path, what: str) -> str:
    """The UTF-8 text of ``path`` (a byte-order mark is dropped); binary or non-UTF-8 content
    is a ValueError naming the file and the offending byte."""
    data = _need(path, what).read_bytes()
    if b"\0" in data:
        raise ValueError(f"{path} is a binary file (a NUL byte at offset {data.index(0)}); expected {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 1].hex()
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{bad} at offset {err.start}); expected {what}") from None


@contextlib.contextmanager
def _long_fields() -> Iterator[None]:
    """Let the csv module read fields of any length (its default limit is 128 KiB), then restore it."""
    old = csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _tsv(path: Path, what: str, **kwargs) -> list[list[str]]:
    """The rows of a tab-separated UTF-8 file; a malformed line is a ValueError naming file and line."""
    text = _read_text(path, what)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", **kwargs)
    with _long_fields():
        try:
            return list(reader)
        except csv.Error as err:
            raise ValueError(f"{path}, line {reader.line_num}: {err}; expected {what}") from None


def load_listops(root: str | Path, max_length: int = 2_000) -> TaskData:
    """``basic_{train,val,test}.tsv`` (LRA release or :func:`listops.generate`) under ``root``."""
    splits = {}
    for split in SPLITS:
        path = Path(root) / f"basic_{split}.tsv"
        rows = _tsv(path, "an LRA ListOps TSV with a 'Source\\tTarget' header")
        if not rows or [c.strip() for c in rows[0][:2]] != ["Source", "Target"]:
            raise ValueError(f"{path}: the first line must be the header 'Source\\tTarget', got {rows[:1]}")
        seqs, labels = [], []
        for line, row in enumerate(rows[1:], start=2):
            try:
                if len(row) != 2:
                    raise ValueError(f"expected 2 tab-separated fields, got {len(row)}")
                if not re.fullmatch(r"[0-9]", row[1].strip()):
                    raise ValueError(f"target must be a digit 0-9, got {row[1]!r}")
                label = int(row[1])
                seqs.append(listops.encode(row[0]))
            except ValueError as err:
                raise ValueError(f"{path}, line {line}: {err}") from None
            labels.append(label)
        _not_empty(labels, path, "expressions after the header")
        tokens, lengths = _pack(seqs, max_length)
        splits[split] = Split(tokens, lengths, torch.tensor(labels, dtype=torch.long))
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
            folder = _need(root / part / name, f"the aclImdb folder {part}/{name} of review .txt files", folder=True)
            files = sorted(folder.glob("*.txt"))
            if not files:
                raise FileNotFoundError(f"{folder} holds no .txt reviews; expected the aclImdb layout")
            seqs += [_byte_ids(_need(f, "a review .txt file").read_bytes(), max_length) for f in files]
            labels += [label] * len(files)
        loaded[part] = Split(*_pack(seqs, max_length), torch.tensor(labels))
    return TaskData({"train": loaded["train"], "val": loaded["test"], "test": loaded["test"]}, 257, 2, max_length)


RETRIEVAL_FILES = {
    "train": "new_aan_pairs.train.tsv",
    "val": "new_aan_pairs.eval.tsv",
    "test": "new_aan_pairs.test.tsv",
}


def _binary_label(text: str, path: Path, line: int) -> int:
    """A label 0 or 1, written as an integer or with a zero fraction ("1", "1.0", as the LRA
    release); anything else (7, -1, 0.9, 1e0, true) is a ValueError."""
    if not re.fullmatch(r"[01](\.0+)?", text.strip()):
        raise ValueError(f"{path}, line {line}: label must be 0 or 1 (an integer), got {text!r}")
    return int(text.strip()[0])


def load_retrieval(root: str | Path, max_length: int = 4_000) -> TaskData:
    """AAN pairs in the LRA release TSVs (``label, id1, id2, text1, text2``), byte-level."""
    splits = {}
    for split, name in RETRIEVAL_FILES.items():
        path = Path(root) / name
        first, second, labels = [], [], []
        rows = _tsv(path, "an LRA AAN TSV with rows 'label\\tid1\\tid2\\ttext1\\ttext2'", quoting=csv.QUOTE_NONE)
        for line, row in enumerate(rows, start=1):
            if len(row) != 5:
                raise ValueError(f"{path}, line {line}: expected 5 tab-separated fields, got {len(row)}")
            labels.append(_binary_label(row[0], path, line))
            first.append(_byte_ids(row[3], max_length))
            second.append(_byte_ids(row[4], max_length))
        _not_empty(labels, path, "pairs")
        tokens, lengths = _pack(first, max_length)
        tokens2, lengths2 = _pack(second, max_length)
        splits[split] = Split(tokens, lengths, torch.tensor(labels), tokens2, lengths2)
    return TaskData(splits, vocab_size=257, num_classes=2, max_length=max_length, dual=True)


def _numpy_global(module: str, name: str) -> Any:
    """The NumPy function a pickled array names, under NumPy 1's module or NumPy 2's."""
    import importlib

    for candidate in (module.replace("numpy.core.", "numpy._core."), module):
        with contextlib.suppress(ImportError, AttributeError):
            return getattr(importlib.import_module(candidate), name)
    raise pickle.UnpicklingError(f"{module}.{name} is not available in this NumPy")


_CIFAR_NUMPY = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
    }
)


class _CifarUnpickler(pickle.Unpickler):
    """Admits only what a CIFAR-10 python batch holds: dicts, lists, bytes, ints and NumPy uint8 arrays."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CIFAR_NUMPY:
            return _numpy_global(module, name)
        if (module, name) == ("numpy", "ndarray"):
            return np.ndarray
        if (module, name) == ("numpy", "dtype"):
            return np.dtype
        if (module, name) == ("_codecs", "encode"):  # how protocol-2 pickles store bytes
            import codecs

            return codecs.encode
        raise pickle.UnpicklingError(f"{module}.{name} is not part of the CIFAR-10 format; refused (not loaded)")


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
        data, labels = batch[b"data"], list(batch[b"labels"])
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise TypeError(f"b'data' is a {type(data).__name__} of {getattr(data, 'dtype', '?')}, not uint8")
        if not all(type(y) is int and 0 <= y <= 9 for y in labels):
            raise ValueError("b'labels' must be ints 0-9 (not bools or floats)")
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        msg = f"{path} is not a CIFAR-10 python batch (a pickled dict with b'data', b'labels'): {err}"
        raise ValueError(msg) from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ValueError(f"{path}: b'data' must be (n, 3072) uint8 with n labels, got {data.shape}, {len(labels)}")
    if not labels:
        raise ValueError(f"{path} holds no images; a CIFAR-10 batch holds (n, 3072) images, n >= 1")
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
    if not 0 <= val_size < len(train):
        raise ValueError(
            f"data.loader.val_size must be in 0 .. {len(train) - 1} (the training images less one), got {val_size}"
        )
    if val_size:
        n = len(train) - val_size
        val = Split(train.tokens[n:], train.lengths[n:], train.labels[n:])
        train = train.subset(n)
    else:
        val = test
    return TaskData({"train": train, "val": val, "test": test}, vocab_size=257, num_classes=10, max_length=1024)


def _grey_image(path: Path) -> np.ndarray:
    """The pixels of an image file as 8-bit grey; a corrupt or non-image file is a ValueError naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("L"))
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"{path} is not a readable image (corrupt or truncated?): {err}") from None


def load_pathfinder(root: str | Path, size: int = 32, difficulty: str = "curv_contour_length_14") -> TaskData:
    """Pathfinder / Path-X in the LRA release layout; split 80/10/10 in sample order.

    ``root`` is the folder holding ``pathfinder{size}/`` (or the difficulty folder itself).
    """
    root = Path(root)
    folder = root if (root / "metadata").is_dir() else root / f"pathfinder{size}" / difficulty
    meta_dir = _need(folder / "metadata", f"the metadata folder of an LRA pathfinder{size} set", folder=True)
    inside = folder.resolve()
    rows = []
    what = "LRA pathfinder metadata: lines 'imgs/<b> sample_<i>.png <i> <label 0|1> ...'"
    for meta in sorted(meta_dir.glob("*.npy"), key=lambda p: (len(p.stem), p.stem)):
        for line_no, line in enumerate(_read_text(meta, what).splitlines(), start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 4 or fields[3] not in ("0", "1"):
                raise ValueError(f"{meta}, line {line_no}: expected 'imgs/<b> sample_<i>.png <i> <label 0|1> ...'")
            path = (folder / fields[0] / fields[1]).resolve()
            if not path.is_relative_to(inside):
                where = f"{fields[0]}/{fields[1]}"
                raise ValueError(f"{meta}, line {line_no}: {where} lies outside the data folder {folder}")
            rows.append((path, int(fields[3])))
    if not rows:
        raise FileNotFoundError(f"{meta_dir} holds no metadata lines; expected LRA pathfinder metadata/*.npy files")
    pixels = np.empty((len(rows), size * size), dtype=np.int16)
    for i, (path, _) in enumerate(rows):
        arr = _grey_image(_need(path, f"a {size}x{size} greyscale PNG listed in the metadata"))
        if arr.shape != (size, size):
            raise ValueError(f"{path}: expected a {size}x{size} image, got {arr.shape}")
        pixels[i] = arr.reshape(-1).astype(np.int16) + 1
    tokens, labels = torch.from_numpy(pixels), torch.tensor([label for _, label in rows])
    n = len(rows)
    if n < 10:
        raise ValueError(
            f"{meta_dir} lists {n} image(s); the 80/10/10 split needs at least 10 so that validation and test "
            "hold one each"
        )
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


def _not_empty(labels: Sequence[Any], path: Path, what: str) -> None:
    if not labels:
        raise ValueError(f"{path} holds no {what}: every split needs at least one sample")


#: the options (``data.loader``) each task's loader takes, and their checks
_OPTION_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_length": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
    "size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
    "val_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number >= 0"),
    "difficulty": (lambda v: isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_]+", v) is not None, "a folder name"),
}


def load(task: str, root: str | Path, **options) -> TaskData:
    """The data of ``task`` (one of :data:`LOADERS`) from ``root``; ``options`` (the config's
    ``data.loader``) are checked first, naming a key the task does not take or a bad value."""
    if task not in LOADERS:
        raise ValueError(f"task must be one of {sorted(LOADERS)}, got {task!r}")
    loader = load_pathfinder if task == "pathx" else LOADERS[task]
    valid = [p for p in inspect.signature(loader).parameters if p != "root" and not (task == "pathx" and p == "size")]
    for key, value in options.items():
        if key not in valid:
            raise ValueError(f"data.loader.{key}: task {task!r} takes no such option; valid: {valid}")
        check, what = _OPTION_CHECKS[key]
        if not check(value):
            raise ValueError(f"data.loader.{key} must be {what}, got {value!r}")
    if not Path(root).exists():
        raise FileNotFoundError(f"data folder {root} not found for task {task!r}")
    return LOADERS[task](root, **options)
