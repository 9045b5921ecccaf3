"""The recall task on the LRA trainer: data as a ``TaskData`` of per-token labels, and its configuration.

Token ids are shifted by one for the encoder (0 is its padding id, and its embedding is
zero): filler 0 becomes 1, a one-hop query's empty value channel stays 0 and adds nothing.
Labels are value - V/2 at query positions and ``IGNORE`` elsewhere; the model is the LRA
encoder with ``pooling="none"`` (a token classifier).

``data.train_lengths`` (default ``[]``: off) makes the training split a length mixture
(``data.generate_mix``): equal shares at each shorter N_i (P_i = min(P, N_i // 4)), padded and
masked, and at N itself; validation and test stay at (N, P). With no positions, the model is
the same at every length, so what it learns on the short sequences (where the value signal is
less diluted by filler) carries over to N.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..lra.config import load_config
from ..lra.data.loaders import Split, TaskData
from . import data as gen

DATA_KEYS = ("seq_len", "num_pairs", "vocab_size", "form")


def config(variant: str = "cpu", overrides: list[str] | None = None, path: str | Path | None = None) -> dict[str, Any]:
    """The recall configuration (``configs/recall.json``, or the JSON file ``path``) with
    ``section.key=value`` overrides."""
    path = path or resources.files("mita_experiments.recall") / "configs" / "recall.json"
    return load_config("recall", variant, overrides, Path(str(path)))


def spec_of(data_config: dict[str, Any]) -> gen.RecallSpec:
    """The ``RecallSpec`` of a configuration's data section."""
    return gen.RecallSpec(**{k: data_config[k] for k in DATA_KEYS if k in data_config})


def _split(
    spec: gen.RecallSpec, tokens: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor | None = None
) -> Split:
    ids = tokens.to(torch.int16) + 1  # filler 0 -> 1; gen.PAD (-1) -> 0, the encoder's padding
    if spec.form == "onehop":
        ids[..., 1] = torch.where(tokens[..., 1] == 0, 0, ids[..., 1])
    labels = torch.where(targets == gen.IGNORE, gen.IGNORE, targets - spec.vocab_size // 2).to(torch.int16)
    if lengths is None:
        lengths = torch.full((len(ids),), spec.seq_len, dtype=torch.long)
    return Split(ids, lengths, labels)


def task_data(data_config: dict[str, Any], root: str | Path | None = None) -> TaskData:
    """The splits of a configuration's data section, generated (seeded by ``data.seed``) or read
    from ``root`` (the output of ``mita recall generate``); ``data.train_lengths`` (generated
    data only) makes the training split a length mixture."""
    mix = list(data_config.get("train_lengths") or [])
    if mix and root is not None:
        raise ValueError("data.train_lengths mixes lengths into generated data; with --data, set it to []")
    if root is not None:
        spec, raw = gen.load(root)
    else:
        spec = spec_of(data_config)
        seeds = gen.split_seeds(int(data_config["seed"]))
        sizes = {name: int(data_config[f"num_{name}"]) for name in gen.SPLITS}
        raw = {
            name: gen.generate_mix(spec, mix, sizes[name], seeds[name])
            if mix and name == "train"
            else gen.generate(spec, sizes[name], seeds[name])
            for name in gen.SPLITS
        }
    missing = [s for s in gen.SPLITS if s not in raw]
    if missing:
        raise ValueError(f"recall data at {root} lacks the split(s) {missing}")
    splits = {name: _split(spec, *raw[name]) for name in gen.SPLITS}
    return TaskData(splits, vocab_size=spec.vocab_size + 1, num_classes=spec.num_classes, max_length=spec.seq_len)
