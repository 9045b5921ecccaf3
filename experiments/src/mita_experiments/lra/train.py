"""LRA on the shared trainer (:mod:`mita_experiments.trainer`): what is LRA's own.

The model of a task's data and config, its loss and accuracy, training a run, evaluating a
checkpoint with another attention or other MiTA m, k, s, and timing a task's model
(:func:`speed`, for ``mita bench``). Labels are one per sample (n,), or one per token (n, L)
with :data:`IGNORE` where a token has none (token classification); loss and accuracy are
then over the labelled tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import trainer
from ..utils.distributed import Dist, init_distributed, parse_device
from .config import TASKS, apply_overrides, check_model
from .data.loaders import META, TaskData
from .models import Classifier, set_attention_options

__all__ = ["IGNORE", "build_model", "evaluate_checkpoint", "lra_task", "resume_config", "scores", "speed", "train"]

#: the label of a token that has none
IGNORE = -100
#: config keys a resumed run may change besides the trainer's (they do not change what is trained)
FREE_KEYS = ("data.generate", "source")


def build_model(config: Mapping[str, Any], meta: Mapping[str, Any], attention: Any) -> Classifier:
    """The classifier for a task's ``meta`` (vocab_size, num_classes, max_length, dual) and a config's model section."""
    return Classifier(
        num_classes=meta["num_classes"],
        dual=meta["dual"],
        vocab_size=meta["vocab_size"],
        max_length=meta["max_length"],
        attention=attention,
        **config["model"],
    )


def scores(model: torch.nn.Module, batch: tuple[list[torch.Tensor], torch.Tensor]) -> trainer.Scores:
    """Summed cross-entropy and number correct of a batch of a :class:`~.data.loaders.Split`."""
    inputs, labels = batch
    return trainer.classification_scores(model(*(t.long() for t in inputs)), labels.long(), IGNORE)


def lra_task(config: Mapping[str, Any], data: TaskData, attention: Any) -> trainer.Task:
    """The trainer's task of LRA: the classifier with ``attention``, the splits, the loss and accuracy."""
    return trainer.Task(
        build_model=lambda: build_model(config, data.meta, attention),
        scores=scores,
        train_data=data.splits["train"],
        eval_data={name: data.splits[name] for name in ("val", "test") if name in data.splits},
        identity={"attention": attention},
        fingerprint=data.fingerprint(),
        free_keys=FREE_KEYS,
        name=f"train {attention if isinstance(attention, str) else json.dumps(attention)}",
    )


def train(
    config: Mapping[str, Any],
    data: TaskData,
    run_dir: str | Path,
    attention: Any = None,
    **options: Any,
) -> dict[str, Any]:
    """Train (or resume) an LRA run in ``run_dir``; returns its summary.

    Args:
        config: the task's configuration (:func:`mita_experiments.lra.config.load_config`).
        data: the task's data (:func:`mita_experiments.lra.data.loaders.load`).
        run_dir: the run folder (see :mod:`mita_experiments.trainer`).
        attention: a registered attention or config; default: on resume the run's own, else
            "sdpa". On resume another attention is refused (one written differently but
            parsing the same is the run's).
        options: the keyword arguments of :func:`mita_experiments.trainer.train` (resume,
            force, stop_after, time_limit, progress, tensorboard, ctx).
    """
    attention = trainer.run_attention(run_dir, attention, bool(options.get("resume")))
    return trainer.train(lra_task(config, data, attention), config, run_dir, **options)


def resume_config(run_dir: str | Path, overrides: Sequence[str] | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The configuration of the run in ``run_dir`` (its manifest), with ``overrides`` applied."""
    if not (Path(run_dir) / trainer.MANIFEST).is_file():
        raise FileNotFoundError(
            f"--resume: {run_dir} holds no run ({trainer.MANIFEST} is missing); start it without --resume, "
            "or give its configuration with --variant or --config"
        )
    return apply_overrides(trainer.read_manifest(run_dir)["config"], overrides)


def evaluate_checkpoint(
    path: str | Path,
    data: TaskData,
    attention: Any = None,
    options: dict[str, Any] | None = None,
    split: str = "test",
    batch_size: int | None = None,
    ctx: Dist | None = None,
    build: Callable[..., torch.nn.Module] = build_model,
    score: Callable[..., trainer.Scores] = scores,
) -> dict[str, Any]:
    """Loss, accuracy and throughput of a checkpoint on ``split``.

    Args:
        path: a run folder (its best.pt, else checkpoint.pt), a .pt or a model.safetensors.
        data: the task's data; its vocabulary, classes, length and form must be the run's.
        attention: evaluate with this attention instead of the trained one (default: the trained one).
        options: call-time attention options, e.g. MiTA's ``num_landmarks`` / ``topk`` (default none).
        split: "train", "val" or "test" (default "test").
        batch_size: samples per forward (default: the run's eval batch size).
        ctx: this process's place in a DDP run (default: :func:`init_distributed`).
        build, score: the task's model builder and scores (default LRA's; recall passes its own).

    The weights must fit the model the checkpoint's config describes exactly: missing or
    unexpected keys and other shapes are a ValueError naming them.
    """
    path = trainer.resolve_checkpoint(path)
    if split not in data.splits:
        raise ValueError(f"split must be one of {list(data.splits)}, got {split!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    ctx = ctx or init_distributed()
    state = trainer.read_checkpoint(path)
    meta = {k: state["data"].get(k) for k in META}
    if meta != data.meta:
        raise ValueError(f"checkpoint {path} was trained on data {meta}, not {data.meta}")
    check_model(state["config"]["model"])
    trained = state["identity"].get("attention")
    used = attention if attention is not None else trained
    model = build(state["config"], meta, used).to(ctx.device)
    trainer.load_model_state(model, state["model"], path)
    if options:
        set_attention_options(model, **options)
    tc = trainer.check_train(state["config"]["train"])
    precision = "fp32" if tc["precision"] == "fp16" and ctx.device.type != "cuda" else tc["precision"]
    size = batch_size or tc["eval_batch_size"] or tc["batch_size"]
    res = trainer.evaluate(model, data.splits[split], score, size, ctx, precision)
    return {
        "checkpoint": str(path),
        "step": state["step"],
        "trained_with": trained,
        "attention": used,
        "options": options or {},
        "split": split,
        **res,
    }


def _task_meta(name: str, length: int) -> dict[str, Any]:
    from .data import listops

    return {
        "vocab_size": len(listops.VOCAB) if name == "listops" else 257,
        "num_classes": 10 if name in ("listops", "image") else 2,
        "max_length": length,
        "dual": name == "retrieval",
    }


def speed(
    task: str,
    config: Mapping[str, Any],
    attention: Any,
    lengths: Sequence[int],
    batch_size: int,
    steps: int = 5,
    warmup: int = 1,
    mode: str = "train",
    device: str = "cpu",
) -> Iterator[dict[str, Any]]:
    """Time a task's whole LRA model at each sequence length, on random tokens.

    Args:
        task: one of :data:`~mita_experiments.lra.config.TASKS` (its vocabulary, classes, dual form).
        config: a configuration whose "model" section is timed (:func:`~mita_experiments.lra.config.load_config`).
        attention: a registered attention or config.
        lengths: sequence lengths, each >= 1.
        batch_size: sequences per step (>= 1).
        steps: timed steps per length (>= 1; default 5).
        warmup: untimed steps before them (>= 0; default 1).
        mode: "train" (forward, backward, AdamW step) or "eval" (inference; default "train").
        device: "cpu", "cuda" or "cuda:N" (default "cpu").

    Yields one row per length: attention, length, mode, batch_size, seconds_per_step (median),
    samples_per_s.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    for name, value, low in (("batch_size", batch_size, 1), ("steps", steps, 1), ("warmup", warmup, 0)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    if not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
        raise ValueError(f"lengths must be whole numbers >= 1, got {list(lengths)!r}")
    check_model(config["model"])
    dev = parse_device(device)
    for n in lengths:
        torch.manual_seed(0)
        meta = _task_meta(task, n)
        model = build_model(config, meta, attention).to(dev).train(mode == "train")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(1, meta["vocab_size"], (batch_size, n), device=dev)
        pair = [tokens, tokens.flip(0)] if meta["dual"] else [tokens]
        labels = torch.randint(0, meta["num_classes"], (batch_size,), device=dev)
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            if mode == "train":
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(*pair), labels).backward()
                opt.step()
            else:
                with torch.no_grad():
                    model(*pair)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        median = float(np.median(times))
        yield {
            "attention": attention if isinstance(attention, str) else json.dumps(attention),
            "length": n,
            "mode": mode,
            "batch_size": batch_size,
            "seconds_per_step": median,
            "samples_per_s": batch_size / median,
        }
