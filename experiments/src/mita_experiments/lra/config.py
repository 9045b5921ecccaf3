"""Named LRA configurations: ``configs/<task>.json`` holds the variants "lra" (Tay et al. 2021),
"small" (the common PyTorch setup of Xiong et al. 2021) and "cpu" (feasible on a laptop).

A variant has the sections "data", "model" and "train"; each variant is the file's
"common" block updated by the variant's own block. Command-line overrides read
``section.key=value`` or, into nested sections, ``data.generate.num_train=2000`` (value
parsed as a Python literal, else kept as a string; :mod:`mita.utils.options`). The numbers
of the "train" section are checked when the configuration is made (:func:`check_train`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from mita.utils.options import apply_assignments, parse_assignments

TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
SECTIONS = ("data", "model", "train")
#: nested sections whose keys are options of a generator or loader, so ``--set`` may add keys there
OPEN_SECTIONS = ("data.generate", "data.loader")
#: train keys that must be whole numbers >= 1, and those that may also be None (no limit)
POSITIVE = ("batch_size", "steps", "accum", "eval_every", "checkpoint_every", "log_every", "eval_batch_size")
POSITIVE_OR_NONE = ("eval_samples", "train_subset")


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read(path: Path | Any) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def variants(task: str) -> list[str]:
    """The variant names of a task's configuration file."""
    return list(_task_file(task)["variants"])


def _task_file(task: str) -> dict[str, Any]:
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    return _read(resources.files("mita_experiments.lra") / "configs" / f"{task}.json")


def load_config(
    task: str,
    variant: str = "cpu",
    overrides: Sequence[str] | Mapping[str, Any] | None = None,
    path: str | Path | None = None,
) -> dict[str, Any]:
    """The configuration of ``task`` / ``variant`` (or of the JSON file ``path``), with overrides applied.

    Args:
        task: one of :data:`TASKS`.
        variant: "lra", "small" or "cpu" (default "cpu").
        overrides: ``["train.steps=200", ...]`` or ``{"train.steps": 200}`` (dotted keys; default none).
        path: a JSON file holding the task-file layout ({"common", "variants"}) or one
            variant ({"data", "model", "train"}) (default: the packaged file).

    Returns:
        The config dict; a ValueError names a bad key or value.
    """
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} not found")
        raw = _read(path)
    else:
        raw = _task_file(task)
    if "variants" in raw:
        if variant not in raw["variants"]:
            raise ValueError(f"variant must be one of {list(raw['variants'])} for {task!r}, got {variant!r}")
        config = _merge(raw.get("common", {}), raw["variants"][variant])
    else:
        config = raw
    missing = [s for s in SECTIONS if not isinstance(config.get(s), dict)]
    if missing:
        raise ValueError(f"config for {task!r} lacks the section(s) {missing}; each of {list(SECTIONS)} is a dict")
    return apply_overrides(config, overrides)


def apply_overrides(config: dict[str, Any], overrides: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` with ``section.key=value`` overrides set (keys must exist outside
    :data:`OPEN_SECTIONS`, so typos fail loudly; a key given twice is an error), then checked."""
    if isinstance(overrides, Mapping):
        assignments = dict(overrides)
    else:
        assignments = parse_assignments(overrides or [], "--set")
    for key in assignments:
        if key.split(".")[0] not in SECTIONS:
            raise ValueError(f"--set {key}: keys read section.key=value with section in {list(SECTIONS)}")
    config = apply_assignments(config, assignments, "--set", OPEN_SECTIONS)
    check_train(config["train"])
    return config


def check_train(train: Mapping[str, Any]) -> None:
    """A ValueError for a number of the train section that would give garbage (batch sizes,
    steps, accumulation, cadences <= 0, a negative warm-up, a non-positive learning rate)."""

    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"train.{key} must be {what}, got {train[key]!r} (set it with --set train.{key}=...)")

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for key in POSITIVE:
        if key in train and not (whole(train[key]) and train[key] >= 1):
            raise bad(key, "a whole number >= 1")
    for key in POSITIVE_OR_NONE:
        if train.get(key) is not None and not (whole(train[key]) and train[key] >= 1):
            raise bad(key, "a whole number >= 1, or null for all")
    if "warmup" in train and not (whole(train["warmup"]) and train["warmup"] >= 0):
        raise bad("warmup", "a whole number >= 0")
    if "lr" in train and not (isinstance(train["lr"], (int, float)) and 0 < train["lr"] < float("inf")):
        raise bad("lr", "a positive number")
