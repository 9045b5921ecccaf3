"""Named LRA configurations: ``configs/<task>.json`` holds the variants "lra" (Tay et al. 2021),
"small" (the common PyTorch setup of Xiong et al. 2021) and "cpu" (feasible on a laptop).

A variant has the sections "data", "model" and "train"; each variant is the file's
"common" block updated by the variant's own block. Command-line overrides read
``section.key=value`` (value parsed as a Python literal, else kept as a string).
"""

from __future__ import annotations

import ast
import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

TASKS = ("listops", "text", "retrieval", "image", "pathfinder", "pathx")
SECTIONS = ("data", "model", "train")


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
    return _read(resources.files("mita.lra") / "configs" / f"{task}.json")


def load_config(
    task: str, variant: str = "cpu", overrides: list[str] | None = None, path: str | Path | None = None
) -> dict[str, Any]:
    """The configuration of ``task`` / ``variant`` (or of the JSON file ``path``), with overrides applied.

    A file at ``path`` holds either the task-file layout ({"common", "variants"}) or one
    variant ({"data", "model", "train"}).
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
    for item in overrides or []:
        config = apply_override(config, item)
    return config


def apply_override(config: dict[str, Any], item: str) -> dict[str, Any]:
    """``config`` with ``section.key=value`` set (the key must exist, so typos fail loudly)."""
    key, eq, text = item.partition("=")
    parts = key.strip().split(".")
    if not eq or len(parts) != 2 or parts[0] not in SECTIONS:
        raise ValueError(f"override {item!r} must read section.key=value with section in {list(SECTIONS)}")
    section, name = parts
    if name not in config[section]:
        raise ValueError(f"override {item!r}: unknown key {name!r}; {section} keys: {sorted(config[section])}")
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = text.strip()
    out = copy.deepcopy(config)
    out[section][name] = value
    return out
