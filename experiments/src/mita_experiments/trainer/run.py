"""The run folder: what it holds, how it is claimed, logged to and read back.

A run folder holds ``config.json`` (the manifest: config, identity, data fingerprint;
written first), ``metrics.csv`` and ``metrics.jsonl`` (one row per log, evaluation and
test), ``tb/`` (TensorBoard), ``checkpoint.pt`` (everything to resume; written atomically),
``best.pt`` (the best-validation weights), ``model.safetensors`` (the final weights, for
exchange) and ``summary.json``. A process training in it holds ``.lock``.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..utils.checkpoint import load_checkpoint, load_weights
from ..utils.files import atomic_write_text, prepare_output_dir, read_json, remove_stale_temporaries, stale_temporary

__all__ = [
    "BEST",
    "CHECKPOINT",
    "MANIFEST",
    "METRICS",
    "METRICS_JSONL",
    "SUMMARY",
    "WEIGHTS",
    "load_model_state",
    "read_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
]

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"
WEIGHTS = "model.safetensors"
MANIFEST = "config.json"
METRICS = "metrics.csv"
METRICS_JSONL = "metrics.jsonl"
SUMMARY = "summary.json"
TENSORBOARD = "tb"
LOCK = ".lock"
#: the files a run writes (and ``--force`` replaces)
RUN_FILES = (CHECKPOINT, BEST, WEIGHTS, MANIFEST, METRICS, METRICS_JSONL, SUMMARY)
#: what a run folder holds before its first checkpoint: such a folder is reused
BEFORE_CHECKPOINT = (MANIFEST, METRICS, METRICS_JSONL, TENSORBOARD, LOCK)
#: the version of the checkpoint layout; another is refused with a message
FORMAT = 1
#: what a checkpoint (and the metadata of model.safetensors) holds besides the weights
RUN_KEYS = ("config", "identity", "data", "step")
#: the safetensors metadata key of a run's description
METADATA_KEY = "mita.run"


def prepare(run_dir: Path, resume: bool, force: bool) -> bool:
    """Check ``run_dir`` before any work (rank 0, holding no lock yet); True if there is a checkpoint to resume.

    Refused: ``resume`` with ``force``; a file, a path under a file, an unwritable folder; a
    folder holding a run (a checkpoint) without ``resume`` or ``force``; a folder holding
    files no run writes, without ``force``. Temporary files a killed save left are no obstacle.
    """
    if resume and force:
        raise ValueError("--resume continues the run in --out and --force starts it over; give one of them")
    prepare_output_dir(run_dir, reuse=True, create=False)
    if (run_dir / CHECKPOINT).is_file():
        if resume:
            return True
        if not force:
            raise FileExistsError(
                f"--out {run_dir} holds a run ({CHECKPOINT}); pass --resume to continue it, --force to start it "
                "over (its run files are replaced) or choose another --out"
            )
    elif run_dir.is_dir():
        other = sorted(
            p.name
            for p in run_dir.iterdir()
            if p.name not in BEFORE_CHECKPOINT and not stale_temporary(p.name, RUN_FILES)
        )
        if other and not force:
            raise FileExistsError(
                f"--out {run_dir} holds files that are not a run's ({', '.join(other[:5])}"
                f"{', ...' if len(other) > 5 else ''}); pass --force to train in it anyway (those files are kept, "
                "run files replaced) or choose another --out"
            )
    return False


def claim(run_dir: Path, resuming: bool, force: bool) -> None:
    """Make the folder ready (rank 0, holding its lock): stale temporaries removed; on a fresh
    start the files of an earlier run (``force``) or of a run killed before its first checkpoint removed."""
    for path in remove_stale_temporaries(run_dir, RUN_FILES):
        print(f"removed {path}, left by a save that was killed", file=sys.stderr)
    if resuming:
        return
    for name in RUN_FILES if force else (METRICS, METRICS_JSONL):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / TENSORBOARD, ignore_errors=True)


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """A run's ``config.json``: {"config", "identity", "data"}; FileNotFoundError / ValueError name the file."""
    path = Path(run_dir) / MANIFEST
    manifest = read_json(path, f"{run_dir} holds no run")
    if not (isinstance(manifest, dict) and isinstance(manifest.get("config"), dict)):
        raise ValueError(f"{path} is not a run manifest: it lacks the 'config' dict")
    manifest.setdefault("identity", {})
    return manifest


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint file of ``path``: a run folder (its ``best.pt``, else ``checkpoint.pt``),
    a ``.pt`` or a ``.safetensors`` file; FileNotFoundError names what is missing."""
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in (BEST, CHECKPOINT) if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"--checkpoint {path} is a folder without {BEST} or {CHECKPOINT}: no run there")
        return found[0]
    if not path.is_file():
        raise FileNotFoundError(f"--checkpoint {path} not found; pass a run folder, a .pt or a .safetensors file")
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A run's ``checkpoint.pt`` / ``best.pt`` (loaded without running code) or ``model.safetensors``:
    at least "model", "config", "identity", "data" and "step"; a ValueError names a file that is not one."""
    path = Path(path)
    if path.suffix == ".safetensors":
        weights, metadata = load_weights(path)
        try:
            state = {**json.loads(metadata[METADATA_KEY]), "model": weights, "format": FORMAT}
        except (KeyError, json.JSONDecodeError, TypeError):
            raise ValueError(f"{path} holds weights but not the run metadata of the mita trainer") from None
    else:
        state = load_checkpoint(path)
    if state.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a checkpoint of this trainer (format {state.get('format')!r}, expected {FORMAT})"
        )
    missing = [k for k in ("model", *RUN_KEYS) if k not in state]
    if missing:
        raise ValueError(f"{path} is not a checkpoint of the mita trainer: it lacks {missing}")
    return state


def weights_metadata(state: dict[str, Any]) -> dict[str, str]:
    """The safetensors metadata of a run's weights (what :func:`read_checkpoint` needs)."""
    return {METADATA_KEY: json.dumps({k: state[k] for k in RUN_KEYS})}


def _few(keys: Sequence[str]) -> str:
    return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """Load ``state`` into ``model`` strictly: a ValueError names the missing and unexpected keys
    and the tensors of another shape (the checkpoint does not belong to this model)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} (model {tuple(own[k].shape)})"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    faults = []
    if missing:
        faults.append(f"missing keys: {_few(missing)}")
    if unexpected:
        faults.append(f"unexpected keys: {_few(unexpected)}")
    if shapes:
        faults.append(f"other shapes: {_few(shapes)}")
    if faults:
        raise ValueError(f"{source} does not fit the model its config describes ({'; '.join(faults)})")
    model.load_state_dict(state)


class Logger:
    """metrics.csv, metrics.jsonl and TensorBoard logs, written by rank 0.

    On resume from a checkpoint at ``step`` the rows after it are dropped, and so are the test
    rows of an unfinished run at ``step`` (an end of training that was interrupted).
    """

    def __init__(
        self, run_dir: Path, fields: list[str], step: int, finished: bool, enabled: bool, tensorboard: bool
    ) -> None:
        self.enabled, self.fields, self.tb = enabled, fields, None
        self.csv, self.jsonl = run_dir / METRICS, run_dir / METRICS_JSONL
        if not enabled:
            return
        rows = []
        if self.jsonl.exists():
            for line in self.jsonl.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                if row["step"] < step or (row["step"] == step and (finished or row["split"] != "test")):
                    rows.append(row)
        text = io.StringIO()
        writer = csv.DictWriter(text, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.csv, text.getvalue())
        atomic_write_text(self.jsonl, "".join(json.dumps(r) + "\n" for r in rows))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=step + 1 if step else None)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.csv, "a", newline="") as f:
            csv.DictWriter(f, self.fields, extrasaction="ignore").writerow({k: row.get(k, "") for k in self.fields})
        with open(self.jsonl, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in row.items():
                if key not in ("step", "epoch", "split", "train_seconds") and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{row['split']}/{key}", float(value), row["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def run_attention(run_dir: str | Path, attention: Any, resume: bool) -> Any:
    """The attention a training command uses: on ``resume`` the run's own (given None, or one written
    differently that parses the same), else ``attention`` or "sdpa". Another one than the run's is
    left for the trainer's resume check to refuse, naming both."""
    from mita.attention import parse

    run = None
    if resume and (Path(run_dir) / MANIFEST).is_file():
        run = read_manifest(run_dir)["identity"].get("attention")
    if attention is None:
        return run if run is not None else "sdpa"
    if run is not None:
        try:
            same = parse(attention) == parse(run)
        except (TypeError, ValueError):
            same = attention == run
        if same:
            return run
    return attention
