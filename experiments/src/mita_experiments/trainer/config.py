"""The trainer's ``train`` section: its keys, their defaults and domains, and the learning-rate schedules.

Every number is checked where the configuration is made (:func:`check_train`), so a bad
value is refused before any work, naming the key and what it may be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["COMPILE_MODES", "DEFAULTS", "PRECISIONS", "REQUIRED", "RESUMABLE", "SCHEDULES", "check_train", "lr_factor"]

SCHEDULES = ("linear", "cosine", "constant", "rsqrt")
PRECISIONS = ("fp32", "bf16", "fp16")
#: torch.compile modes of the training forward (train.compile); null: eager
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
#: keys a train section must hold
REQUIRED = ("batch_size", "steps", "lr")
#: the other keys, with their defaults
DEFAULTS: dict[str, Any] = {
    "accum": 1,
    "seed": 0,
    "schedule": "constant",
    "warmup": 0,
    "min_lr": 0.0,
    "weight_decay": 0.0,
    "betas": [0.9, 0.999],
    "grad_clip": None,
    "precision": "fp32",
    "compile": None,
    "ema": None,
    "log_every": 10,
    "eval_every": 500,
    "checkpoint_every": 500,
    "eval_batch_size": None,
    "eval_samples": None,
    "train_subset": None,
    "stop_at_accuracy": None,
}
#: train keys a resumed run may change; any other key of the config may not
RESUMABLE = (
    "steps",
    "compile",
    "eval_every",
    "checkpoint_every",
    "log_every",
    "eval_samples",
    "eval_batch_size",
    "stop_at_accuracy",
)
_WHOLE_POSITIVE = ("batch_size", "steps", "accum", "log_every", "eval_every", "checkpoint_every")
_WHOLE_POSITIVE_OR_NONE = ("eval_batch_size", "eval_samples", "train_subset")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_train(train: Mapping[str, Any]) -> dict[str, Any]:
    """The train section with its defaults filled in; a ValueError names the first bad key.

    Domains: batch_size, steps, accum, log_every, eval_every, checkpoint_every whole
    numbers >= 1; eval_batch_size (default: batch_size), eval_samples, train_subset whole
    numbers >= 1 or null (all); warmup and seed whole numbers >= 0; lr > 0; min_lr in
    [0, lr]; weight_decay >= 0; grad_clip >= 0 or null (0 and null: no clipping); betas two
    numbers in [0, 1); ema (decay of an exponential moving average of the weights) in
    [0, 1) or null (off); stop_at_accuracy in (0, 1] or null; schedule one of
    :data:`SCHEDULES`; precision one of :data:`PRECISIONS`; compile one of
    :data:`COMPILE_MODES` or null (eager).
    """
    if not isinstance(train, Mapping):
        raise ValueError(f"the train section must be a dict of settings, got {type(train).__name__}")
    unknown = sorted(set(train) - set(REQUIRED) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"train: unknown key(s) {unknown}; valid: {sorted([*REQUIRED, *DEFAULTS])}")
    missing = [key for key in REQUIRED if key not in train]
    if missing:
        raise ValueError(f"train: missing key(s) {missing} (set them with --set train.KEY=...)")
    out = {**DEFAULTS, **train}

    def bad(key: str, what: str) -> ValueError:
        return ValueError(f"train.{key} must be {what}, got {out[key]!r} (set it with --set train.{key}=...)")

    for key in _WHOLE_POSITIVE:
        if not (_whole(out[key]) and out[key] >= 1):
            raise bad(key, "a whole number >= 1")
    for key in _WHOLE_POSITIVE_OR_NONE:
        if out[key] is not None and not (_whole(out[key]) and out[key] >= 1):
            raise bad(key, "a whole number >= 1, or null")
    for key in ("warmup", "seed"):
        if not (_whole(out[key]) and out[key] >= 0):
            raise bad(key, "a whole number >= 0")
    if not (_number(out["lr"]) and out["lr"] > 0):
        raise bad("lr", "a positive number")
    if not (_number(out["min_lr"]) and 0 <= out["min_lr"] <= out["lr"]):
        raise bad("min_lr", f"a number in [0, train.lr = {out['lr']}]")
    if not (_number(out["weight_decay"]) and out["weight_decay"] >= 0):
        raise bad("weight_decay", "a number >= 0")
    if out["grad_clip"] is not None and not (_number(out["grad_clip"]) and out["grad_clip"] >= 0):
        raise bad("grad_clip", "a number >= 0 (the largest gradient norm), or null for no clipping")
    betas = out["betas"]
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
        raise bad("betas", "two numbers in [0, 1), e.g. [0.9, 0.999]")
    if out["ema"] is not None and not (_number(out["ema"]) and 0 <= out["ema"] < 1):
        raise bad("ema", "a decay in [0, 1), e.g. 0.9999, or null for none")
    target = out["stop_at_accuracy"]
    if target is not None and not (_number(target) and 0 < target <= 1):
        raise bad("stop_at_accuracy", "a number in (0, 1], or null")
    if out["schedule"] not in SCHEDULES:
        raise bad("schedule", f"one of {list(SCHEDULES)}")
    if out["precision"] not in PRECISIONS:
        raise bad("precision", f"one of {list(PRECISIONS)}")
    if out["compile"] is not None and out["compile"] not in COMPILE_MODES:
        raise bad("compile", f"one of {list(COMPILE_MODES)}, or null for eager")
    out["betas"] = [float(b) for b in betas]
    return out


def lr_factor(step: int, schedule: str, warmup: int, total: int, floor: float = 0.0) -> float:
    """The learning-rate multiplier at ``step`` (0-based).

    Linear warm-up over ``warmup`` steps, then "linear" / "cosine" decay from 1 to ``floor``
    at step ``total``, "constant", or LRA's "rsqrt" (min(1, t/w) / sqrt(max(t, w)), t = step + 1).
    """
    t = step + 1
    warm = min(1.0, t / warmup) if warmup > 0 else 1.0
    if schedule == "rsqrt":
        return warm / math.sqrt(max(t, warmup, 1))
    if schedule not in SCHEDULES:
        raise ValueError(f"train.schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if t <= warmup or schedule == "constant":
        return warm
    frac = min(1.0, (t - warmup) / max(1, total - warmup))
    decay = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return floor + (1.0 - floor) * decay
