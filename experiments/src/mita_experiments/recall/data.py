"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), bidirectional, spec section 9.

A sequence of length N holds P key-value pairs at its start, then the P keys again as
queries, in a random order, at random positions after the pairs; every other position
holds the filler token 0. Keys are distinct and drawn from the first half of a
vocabulary of V tokens (ids 1 .. V/2 - 1; 0 is the filler), values from the second half
(V/2 .. V - 1, with repetition). The target at a query position is its key's value;
every other position has the target ``IGNORE``.

Two forms:

- ``"interleaved"`` (the spec's form): ``k1 v1 k2 v2 ... kP vP`` fill positions 0 .. 2P-1;
  ``tokens`` is (n, N).
- ``"onehop"`` (the form that trains on CPU): pair i sits at position i, holding its key in
  channel 0 and its value in channel 1 (the model sums their embeddings); a query holds its
  key in channel 0 and no value (0) in channel 1; ``tokens`` is (n, N, 2).

Sequences are drawn in chunks of ``CHUNK``, chunk c from a CPU ``torch.Generator`` seeded
with ``seed * 1_000_003 + c``, so a seed gives the same sequences on any machine (with the
same PyTorch), and the first n sequences do not depend on how many are drawn.

On disk (``save`` / ``load``): one ``<split>.npz`` per split holding ``tokens`` and
``targets`` (int16, the layout above), and ``meta.json`` with the ``RecallSpec`` fields.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..utils.files import atomic_write, atomic_write_text

IGNORE = -100
#: the token of the positions past a sequence's end in a length mixture (``generate_mix``): not
#: filler, but padding that the model masks out
PAD = -1
CHUNK = 1024
FORMS = ("onehop", "interleaved")
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class RecallSpec:
    """One recall setting.

    Args:
        seq_len: N, tokens per sequence.
        num_pairs: P, key-value pairs (and queries) per sequence.
        vocab_size: V, even; keys from 1 .. V/2 - 1, values from V/2 .. V - 1 (default 128).
        form: "onehop" (default) or "interleaved".
    """

    seq_len: int
    num_pairs: int
    vocab_size: int = 128
    form: str = "onehop"

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {list(FORMS)}, got {self.form!r}")
        if self.vocab_size < 4 or self.vocab_size % 2:
            raise ValueError(f"vocab_size must be even and >= 4, got {self.vocab_size}")
        if not 1 <= self.num_pairs <= self.vocab_size // 2 - 1:
            raise ValueError(
                f"num_pairs must be in 1 .. vocab_size/2 - 1 = {self.vocab_size // 2 - 1} (keys are distinct), "
                f"got {self.num_pairs}; raise vocab_size"
            )
        if self.seq_len < self.context_len + self.num_pairs:
            raise ValueError(
                f"seq_len={self.seq_len} cannot hold {self.num_pairs} pairs ({self.context_len} positions) "
                f"and {self.num_pairs} queries; need seq_len >= {self.context_len + self.num_pairs}"
            )

    @property
    def context_len(self) -> int:
        """Positions taken by the pairs: P (one-hop) or 2P (interleaved)."""
        return self.num_pairs * (1 if self.form == "onehop" else 2)

    @property
    def num_classes(self) -> int:
        """Values a target can take: V/2 (class c is value V/2 + c)."""
        return self.vocab_size // 2


def _chunk(spec: RecallSpec, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    N, P, half = spec.seq_len, spec.num_pairs, spec.vocab_size // 2
    rows = torch.arange(n)[:, None]
    keys = torch.rand(n, half - 1, generator=generator).argsort(1)[:, :P] + 1  # distinct, 1 .. V/2-1
    values = torch.randint(half, spec.vocab_size, (n, P), generator=generator)
    start = spec.context_len
    slots = torch.rand(n, N - start, generator=generator).argsort(1)[:, :P] + start  # distinct, random order
    channels = 2 if spec.form == "onehop" else 1
    tokens = torch.zeros(n, N, channels, dtype=torch.long)
    if spec.form == "onehop":
        tokens[:, :P, 0], tokens[:, :P, 1] = keys, values
    else:
        tokens[:, 0:start:2, 0], tokens[:, 1:start:2, 0] = keys, values
    tokens[rows, slots, 0] = keys
    targets = torch.full((n, N), IGNORE, dtype=torch.long)
    targets[rows, slots] = values
    if spec.form == "interleaved":
        tokens = tokens[..., 0]
    return tokens, targets


def generate(spec: RecallSpec, num: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``num`` sequences of ``spec``: tokens (num, N, 2) one-hop or (num, N) interleaved, and
    targets (num, N) with the value at query positions and ``IGNORE`` elsewhere (int16 both)."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    tok_parts, tgt_parts = [], []
    for c in range(math.ceil(num / CHUNK)):
        g = torch.Generator().manual_seed(seed * 1_000_003 + c)
        tokens, targets = _chunk(spec, CHUNK, g)
        count = min(CHUNK, num - c * CHUNK)
        tok_parts.append(tokens[:count].to(torch.int16))
        tgt_parts.append(targets[:count].to(torch.int16))
    if not tok_parts:
        shape = (0, spec.seq_len, 2) if spec.form == "onehop" else (0, spec.seq_len)
        return torch.zeros(shape, dtype=torch.int16), torch.zeros(0, spec.seq_len, dtype=torch.int16)
    return torch.cat(tok_parts), torch.cat(tgt_parts)


def mix_specs(spec: RecallSpec, lengths: list[int]) -> list[RecallSpec]:
    """The settings of a length mixture: ``spec`` at each shorter N_i of ``lengths`` with
    P_i = min(P, N_i // 4) pairs (the same vocabulary and form), then ``spec`` itself."""
    out = []
    for n in sorted({int(n) for n in lengths}):
        if not 4 <= n < spec.seq_len:
            raise ValueError(f"train lengths must be in 4 .. seq_len-1 = {spec.seq_len - 1}, got {n}")
        out.append(RecallSpec(n, min(spec.num_pairs, n // 4), spec.vocab_size, spec.form))
    return [*out, spec]


def generate_mix(
    spec: RecallSpec, lengths: list[int], num: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num`` sequences in equal shares over the settings of ``mix_specs(spec, lengths)``, each
    padded with ``PAD`` to N (targets ``IGNORE`` there): tokens and targets as ``generate``, and
    the real length of each sequence. Setting i is drawn with the seed ``seed + 1_000_000 * (i + 1)``
    (streams apart from the splits' own seeds)."""
    specs = mix_specs(spec, lengths)
    shares = [num // len(specs) + (i < num % len(specs)) for i in range(len(specs))]
    toks, tgts, lens = [], [], []
    for i, (s, n) in enumerate(zip(specs, shares)):
        tokens, targets = generate(s, n, seed + 1_000_000 * (i + 1))
        pad = spec.seq_len - s.seq_len
        tokens = torch.nn.functional.pad(tokens, (0, 0, 0, pad) if tokens.dim() == 3 else (0, pad), value=PAD)
        toks.append(tokens)
        tgts.append(torch.nn.functional.pad(targets, (0, pad), value=IGNORE))
        lens.append(torch.full((n,), s.seq_len, dtype=torch.long))
    return torch.cat(toks), torch.cat(tgts), torch.cat(lens)


def split_seeds(seed: int) -> dict[str, int]:
    """The generator seed of each split: disjoint streams for train, val and test."""
    return {name: 3 * seed + i for i, name in enumerate(SPLITS)}


def save(out: str | Path, spec: RecallSpec, sizes: dict[str, int], seed: int = 0, overwrite: bool = False) -> Path:
    """Write ``<split>.npz`` (tokens, targets) for each split of ``sizes`` and ``meta.json`` under ``out``
    (each file atomically); existing files are replaced only with ``overwrite``."""
    out = Path(out)
    unknown = set(sizes) - set(SPLITS)
    if unknown:
        raise ValueError(f"split names must be among {list(SPLITS)}, got {sorted(unknown)}")
    paths = [out / f"{name}.npz" for name in sizes] + [out / "meta.json"]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} exist; pass --force to replace them")
    out.mkdir(parents=True, exist_ok=True)
    seeds = split_seeds(seed)
    for name, num in sizes.items():
        tokens, targets = generate(spec, num, seeds[name])
        with atomic_write(out / f"{name}.npz") as f:
            np.savez(f, tokens=tokens.numpy(), targets=targets.numpy())
    meta = {**asdict(spec), "seed": seed, "sizes": sizes}
    atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return out


def _read_split(path: Path, spec: RecallSpec, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and targets of one ``<split>.npz``, checked against ``spec``; a ValueError names the fault."""
    try:
        with np.load(path, allow_pickle=False) as f:
            tokens, targets = f["tokens"], f["targets"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path} is not a recall split (an .npz of 'tokens' and 'targets'): {err}") from None
    n, N = size, spec.seq_len
    want = (n, N, 2) if spec.form == "onehop" else (n, N)
    if tokens.shape != want or targets.shape != (n, N):
        raise ValueError(
            f"{path}: tokens {tokens.shape} and targets {targets.shape} do not fit meta.json "
            f"(tokens {want}, targets {(n, N)})"
        )
    for name, array in (("tokens", tokens), ("targets", targets)):
        if array.dtype.kind not in "iu":
            raise ValueError(f"{path}: {name} must hold integers, got {array.dtype}")
    V, half = spec.vocab_size, spec.vocab_size // 2
    if tokens.size and not (tokens.min() >= 0 and tokens.max() < V):
        raise ValueError(
            f"{path}: tokens range over {tokens.min()} .. {tokens.max()}, outside the vocabulary 0 .. {V - 1} "
            "of meta.json's vocab_size"
        )
    labelled = targets[targets != IGNORE]
    if labelled.size and not (labelled.min() >= half and labelled.max() < V):
        raise ValueError(
            f"{path}: targets range over {labelled.min()} .. {labelled.max()}; a target is a value "
            f"{half} .. {V - 1}, or {IGNORE} where there is none"
        )
    return torch.from_numpy(tokens.astype(np.int16)), torch.from_numpy(targets.astype(np.int16))


def load(root: str | Path) -> tuple[RecallSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Read what ``save`` wrote: the spec and {split: (tokens, targets)}, every file checked
    (split names, sizes, shapes, token and target ranges) and kept inside ``root``."""
    root = Path(root)
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found; expected the output of `mita recall generate`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{meta_path} is not valid JSON: {err}") from None
    keys = ("seq_len", "num_pairs", "vocab_size", "form")
    if not (isinstance(meta, dict) and all(k in meta for k in keys) and isinstance(meta.get("sizes"), dict)):
        raise ValueError(f"{meta_path} must be an object with {[*keys, 'sizes']}, as `mita recall generate` writes")
    try:
        spec = RecallSpec(**{k: meta[k] for k in keys})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{meta_path}: {err}") from None
    inside = root.resolve()
    splits = {}
    for name, size in meta["sizes"].items():
        if name not in SPLITS:
            raise ValueError(f"{meta_path} names the split {name!r}; splits are {list(SPLITS)}")
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
            raise ValueError(f"{meta_path}: the size of split {name!r} must be a whole number >= 0, got {size!r}")
        path = root / f"{name}.npz"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; meta.json lists split {name!r}")
        if not path.resolve().is_relative_to(inside):
            raise ValueError(f"{path} leads outside the data folder {root}; every split must lie in it")
        splits[name] = _read_split(path, spec, size)
    return spec, splits
