"""Named LRA configurations: ``configs/<task>.json`` holds the variants "lra" (Tay et al. 2021),
"small" (the common PyTorch setup of Xiong et al. 2021) and "cpu" (feasible on a laptop).

A variant has the sections "data", "model" and "train"; each variant is the file's
"common" block updated by the variant's own block. Command-line overrides read
``section.key=value`` or, into nested sections, ``data.generate.num_train=2000`` (value
parsed as a Python literal, else kept as a string; :mod:`mita.utils.options`). The "train"
section is the trainer's (:func:`mita_experiments.trainer.check_train`: its defaults are
filled in, so ``--set`` reaches every key) and "model" the encoder's (:func:`check_model`);
both are checked when the configuration is made.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from mita.utils.options import apply_assignments, parse_assignments

from ..trainer import DEFAULTS, check_train
from ..utils.files import read_json

TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
SECTIONS = ("data", "model", "train")
#: nested sections whose keys are options of a generator or loader, so ``--set`` may add keys there
OPEN_SECTIONS = ("data.generate", "data.loader")
#: the keys of the model section (the encoder's options)
MODEL_KEYS = ("dim", "depth", "num_heads", "mlp_dim", "head_dim", "pooling", "positions", "dropout", "attn_dropout")
POOLINGS = ("cls", "mean", "none")
POSITIONS = ("learned", "sinusoidal", "none")


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _read(path: Path | Any) -> dict[str, Any]:
    raw = read_json(path, "expected a JSON config file")
    if not isinstance(raw, dict):
        raise ValueError(
            f"{path} holds a JSON {type(raw).__name__}; a config is an object with the sections "
            f"{list(SECTIONS)} (or 'common' and 'variants')"
        )
    return raw


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
        raw = _read(Path(path))
    else:
        raw = _task_file(task)
    if "variants" in raw:
        if not isinstance(raw["variants"], dict) or variant not in raw["variants"]:
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
    config = {**config, "train": {**DEFAULTS, **config["train"]}}
    config = apply_assignments(config, assignments, "--set", OPEN_SECTIONS)
    config["train"] = check_train(config["train"])
    check_model(config["model"])
    return config


def check_model(model: Mapping[str, Any]) -> None:
    """A ValueError for a key of the model section the encoder does not take, or a value it
    cannot build: dim, depth, num_heads, mlp_dim whole numbers >= 1; head_dim >= 1 or null
    (dim / num_heads, which must then divide); dropout and attn_dropout in [0, 1); pooling one
    of :data:`POOLINGS`; positions one of :data:`POSITIONS`."""
    unknown = sorted(set(model) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"model: unknown key(s) {unknown}; valid: {list(MODEL_KEYS)}")

    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"model.{key} must be {what}, got {model[key]!r} (set it with --set model.{key}=...)")

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    for key in ("dim", "depth", "num_heads", "mlp_dim"):
        if key in model and not whole(model[key]):
            raise bad(key, "a whole number >= 1")
    if model.get("head_dim") is not None and not whole(model["head_dim"]):
        raise bad("head_dim", "a whole number >= 1, or null for dim / num_heads")
    for key in ("dropout", "attn_dropout"):
        value = model.get(key, 0.0)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1):
            raise bad(key, "a probability in [0, 1)")
    if model.get("pooling", "mean") not in POOLINGS:
        raise bad("pooling", f"one of {list(POOLINGS)}")
    if model.get("positions", "learned") not in POSITIONS:
        raise bad("positions", f"one of {list(POSITIONS)}")
    dim, heads = model.get("dim", 64), model.get("num_heads", 2)
    if model.get("head_dim") is None and dim % heads:
        raise ValueError(
            f"model.dim={dim} is not divisible by model.num_heads={heads}; change one or set model.head_dim"
        )
