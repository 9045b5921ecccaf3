"""Training and evaluation of LRA models: one process or several under ``torchrun`` (DDP).

Exact resume: the batch of step t is a slice of a permutation seeded by (seed, epoch),
and the dropout RNG is re-seeded from (seed, step, rank) before every step, so a run
restored from a checkpoint (model, optimizer, scheduler, scaler, step, RNG states)
continues exactly as if it had never stopped. A global batch is split over ranks and
then into ``accum`` micro-batches; the loss is the sum over the global batch divided
by its size, so any (ranks x accumulation) split computes the same update.

Labels are one per sample (n,), or one per token (n, L) with ``IGNORE`` where a token has
none (token classification, the recall task); loss and accuracy are then over the labelled
tokens, and the global batch's size is its number of labelled tokens.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import random
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..utils.checkpoint import load_checkpoint, load_weights, save_checkpoint, save_weights
from ..utils.distributed import Dist, init_distributed
from ..utils.files import atomic_write_text, prepare_output_dir
from .config import apply_overrides
from .data.loaders import Split, TaskData
from .models import Classifier, set_attention_options

__all__ = [
    "Dist",
    "build_model",
    "evaluate",
    "evaluate_checkpoint",
    "init_distributed",
    "lr_factor",
    "resume_config",
    "speed",
    "train",
]

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"
WEIGHTS = "model.safetensors"  # the best-validation weights, for exchange (written at the end of a run)
MANIFEST = "config.json"  # written first: what the run is
METRICS = "metrics.csv"
#: what a run folder holds before its first checkpoint: such a folder may be reused
BEFORE_CHECKPOINT = (MANIFEST, METRICS, "tb")
#: train keys a resumed run may change; anything else in the config (and the attention, the data) may not
RESUMABLE = (
    "steps",
    "eval_every",
    "checkpoint_every",
    "log_every",
    "eval_samples",
    "eval_batch_size",
    "stop_at_accuracy",
)
#: the label of a token that has none (recall: every position but the queries)
IGNORE = -100
CSV_FIELDS = ["step", "epoch", "split", "loss", "accuracy", "lr", "samples_per_s", "train_seconds"]


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """Learning-rate multiplier at ``step``: linear warmup, then "linear" / "cosine" decay to 0,
    "constant", or LRA's "rsqrt" (min(1, t/w) / sqrt(max(t, w)))."""
    t = step + 1
    warm = min(1.0, t / warmup) if warmup > 0 else 1.0
    if schedule == "rsqrt":
        return warm / math.sqrt(max(t, warmup, 1))
    if t <= warmup or schedule == "constant":
        return warm
    frac = min(1.0, (t - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - frac
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"train.schedule must be 'linear', 'cosine', 'constant' or 'rsqrt', got {schedule!r}")


def build_model(config: dict[str, Any], data_meta: dict[str, Any], attention: Any) -> Classifier:
    """The classifier for a task's metadata (vocab, classes, length, dual) and the config's model section."""
    return Classifier(
        num_classes=data_meta["num_classes"],
        dual=data_meta["dual"],
        vocab_size=data_meta["vocab_size"],
        max_length=data_meta["max_length"],
        attention=attention,
        **config["model"],
    )


def meta_of(data: TaskData) -> dict[str, Any]:
    return {k: getattr(data, k) for k in ("vocab_size", "num_classes", "max_length", "dual")}


def _batch(split: Split, idx: torch.Tensor, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Inputs (trimmed to the longest real sequence) and labels of the samples ``idx``."""
    width = max(1, int(split.lengths[idx].max()))
    inputs = [split.tokens[idx, :width].to(device, torch.long)]
    if split.tokens2 is not None:
        inputs.append(split.tokens2[idx, : max(1, int(split.lengths2[idx].max()))].to(device, torch.long))
    labels = split.labels[idx]
    return inputs, (labels[:, :width] if labels.dim() == 2 else labels).to(device, torch.long)


def num_targets(labels: torch.Tensor) -> int:
    """Labelled entries of ``labels``: its length for per-sample labels, the non-``IGNORE`` tokens else."""
    return int((labels != IGNORE).sum())


def scores(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and number correct of ``logits`` (B, C) or (B, N, C) against
    ``labels`` (B,) or (B, N), ``IGNORE`` entries left out."""
    logits, labels = logits.flatten(0, -2), labels.flatten()
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    correct = ((logits.detach().argmax(-1) == labels) & (labels != IGNORE)).sum()
    return loss, correct


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in ("bf16", "fp16"):
        raise ValueError(f"train.precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("train.precision='fp16' needs a CUDA device; use 'bf16' or 'fp32' on CPU")
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    split: Split,
    batch_size: int,
    ctx: Dist,
    precision: str = "fp32",
    max_samples: int | None = None,
) -> dict[str, float]:
    """Loss, accuracy and throughput (samples/s) on ``split`` (sharded over ranks)."""
    was_training = model.training
    model.eval()
    n = len(split) if max_samples is None else min(len(split), max_samples)
    idx = torch.arange(ctx.rank, n, ctx.world)
    loss = correct = seconds = 0.0
    for lo in range(0, len(idx), batch_size):
        inputs, labels = _batch(split, idx[lo : lo + batch_size], ctx.device)
        start = time.perf_counter()
        with _autocast(ctx.device, precision):
            logits = model(*inputs).float()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        seconds += time.perf_counter() - start
        batch_loss, batch_correct = scores(logits, labels)
        loss += float(batch_loss)
        correct += float(batch_correct)
    targets = num_targets(split.labels[:n])
    loss, correct, seconds_sum = ctx.all_sum([loss, correct, seconds])
    model.train(was_training)
    return {
        "loss": loss / max(targets, 1),
        "accuracy": correct / max(targets, 1),
        "samples_per_s": n / max(seconds_sum / ctx.world, 1e-9),
    }


def batch_indices(num_samples: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """The global batch of ``step``: a slice of epoch ``step // steps_per_epoch``'s seeded permutation."""
    per_epoch = num_samples // global_batch
    if per_epoch < 1:
        raise ValueError(f"train.batch_size={global_batch} exceeds the {num_samples} training samples")
    epoch, pos = divmod(step, per_epoch)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[pos * global_batch : (pos + 1) * global_batch]


def _step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def _rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain types (a checkpoint loads with ``weights_only=True``)."""
    np_state = np.random.get_state(legacy=False)
    key = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
    state = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {**np_state["state"], "key": key}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    key = np_state["state"]["key"].numpy().astype(np.uint32)
    np.random.set_state({**np_state, "state": {**np_state["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Logger:
    """CSV and TensorBoard logs of the main rank; on resume, rows after the checkpoint are dropped."""

    def __init__(self, run_dir: Path, step: int, enabled: bool, tensorboard: bool) -> None:
        self.enabled, self.path, self.tb = enabled, run_dir / METRICS, None
        if not enabled:
            return
        kept = []
        if self.path.exists():
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, CSV_FIELDS)
            writer.writeheader()
            writer.writerows(kept)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=step + 1 if step else None)

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, CSV_FIELDS).writerow({k: row.get(k, "") for k in CSV_FIELDS})
        if self.tb is not None:
            for key in ("loss", "accuracy", "lr", "samples_per_s"):
                if row.get(key, "") != "":
                    self.tb.add_scalar(f"{row['split']}/{key}", float(row[key]), row["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def prepare_run_dir(run_dir: Path, resume: bool, ctx: Dist) -> bool:
    """Check the run folder before any work: returns True when there is a checkpoint to resume.

    A folder holding a checkpoint is continued only with ``resume=True`` (a FileExistsError
    otherwise: a run is never overwritten). A folder holding only what a run writes before
    its first checkpoint (:data:`BEFORE_CHECKPOINT`: a run killed early) is reused, with or
    without ``resume``. Anything else non-empty, a file, a path under a file or an
    unwritable folder is refused.
    """
    if resume and (run_dir / CHECKPOINT).is_file():
        prepare_output_dir(run_dir, reuse=True, create=False)
        return True
    if (run_dir / CHECKPOINT).is_file():
        raise FileExistsError(
            f"run folder {run_dir} holds a run ({CHECKPOINT}); pass --resume to continue it or choose another --out"
        )
    hint = "it holds no run to --resume; choose another --out"
    prepare_output_dir(run_dir, ignore=BEFORE_CHECKPOINT, create=ctx.main, hint=hint)
    if resume and ctx.main:
        print(f"--resume: no {CHECKPOINT} in {run_dir} yet: the run starts from step 0", file=sys.stderr)
    return False


def resume_config(run_dir: str | Path, overrides: Sequence[str] | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The configuration of the run in ``run_dir`` (its manifest), with ``overrides`` applied."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: {run_dir} holds no run ({MANIFEST} is missing); start it without --resume, "
            "or give its configuration with --variant or --config"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        config = manifest["config"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a run manifest written by mita lra train: {err}") from None
    return apply_overrides(config, overrides)


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x))  # tuples and lists compare equal after this


def _changed(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if _json(old) == _json(new) else [prefix.rstrip(".") or "the config"]
    return [k for key in sorted(set(old) | set(new)) for k in _changed(old.get(key), new.get(key), f"{prefix}{key}.")]


def _same_attention(a: Any, b: Any) -> bool:
    from mita.attention import parse

    try:
        return parse(a) == parse(b)
    except ValueError:
        return _json(a) == _json(b)


def _check_resume(state: dict[str, Any], config: dict[str, Any], attention: Any, data: TaskData) -> list[str]:
    """Refuse what a resumed run may not change (data, attention, model, optimisation); the changed keys."""
    if state["meta"] != meta_of(data):
        raise ValueError(f"--resume: the run was trained on data {state['meta']}, not {meta_of(data)}")
    if attention is not None and not _same_attention(attention, state["attention"]):
        raise ValueError(
            f"--resume: the run was trained with attention {state['attention']!r}, not {attention!r}; the attention "
            "cannot change on resume (evaluate another one with mita lra eval --attention, or start a new --out)"
        )
    changed = [k for k in _changed(state["config"], config) if not k.startswith(("data.generate", "source"))]
    frozen = [k for k in changed if not (k.startswith("train.") and k.split(".", 1)[1] in RESUMABLE)]
    if frozen:
        was = ", ".join(f"{k}: {_get(state['config'], k)!r} -> {_get(config, k)!r}" for k in frozen)
        allowed = ", ".join(f"train.{k}" for k in RESUMABLE)
        raise ValueError(f"--resume cannot change {was}; only {allowed} may change (start a new --out for the rest)")
    return changed


def _get(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def train(
    config: dict[str, Any],
    data: TaskData,
    run_dir: str | Path,
    attention: Any = None,
    resume: bool = False,
    stop_after: int | None = None,
    time_limit: float | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    ctx: Dist | None = None,
) -> dict[str, Any]:
    """Train (or resume) a run in ``run_dir``; returns its summary (also written to ``summary.json``).

    Args:
        config: the task's configuration (:func:`mita_experiments.lra.config.load_config`).
        data: the task's data (:func:`mita_experiments.lra.data.loaders.load`).
        run_dir: the run folder: ``config.json`` (written first), ``metrics.csv``, ``tb/``,
            ``checkpoint.pt``, ``best.pt``, ``model.safetensors`` (best-validation weights) and
            ``summary.json``.
        attention: a registered attention or config (default: "sdpa", or on resume the run's).
        resume: continue from ``run_dir/checkpoint.pt`` (or start a folder with none). Of
            ``config`` only :data:`RESUMABLE` train keys may differ from the run's (e.g. more
            steps: the schedule is recomputed for the new total); anything else, another
            attention or other data is a ValueError.
        stop_after: stop with a checkpoint once this many steps are done (default: never).
        time_limit: stop with a checkpoint after this many seconds of this call (default: never).
        progress: show a progress bar (default True).
        tensorboard: also write TensorBoard logs (default True).
        ctx: this process's place in a DDP run (default: :func:`init_distributed`).

    ``train.stop_at_accuracy`` (optional, in (0, 1]; default: absent or null, never): end the
    run early, as finished (test evaluation included), at the first validation whose accuracy
    reaches it; the summary's ``step`` is then the step it stopped at and ``solved_at`` that step.
    """
    from tqdm import tqdm

    ctx = ctx or init_distributed()
    run_dir = Path(run_dir)
    resuming = prepare_run_dir(run_dir, resume, ctx)
    ctx.barrier()
    state = load_checkpoint(run_dir / CHECKPOINT) if resuming else None
    changed: list[str] = []
    if state is not None:
        changed = _check_resume(state, config, attention, data)
        attention = state["attention"]
        if changed and ctx.main:
            print(f"--resume: changed {', '.join(changed)}", file=sys.stderr)
    attention = "sdpa" if attention is None else attention
    if ctx.main and (state is None or changed):
        atomic_write_text(run_dir / MANIFEST, json.dumps({"config": config, "attention": attention}, indent=2))
    if ctx.main and state is None:  # a reused folder: no logs of the run that never checkpointed
        import shutil

        shutil.rmtree(run_dir / "tb", ignore_errors=True)
        (run_dir / METRICS).unlink(missing_ok=True)
    tc = config["train"]
    gb, accum, steps = int(tc["batch_size"]), int(tc.get("accum", 1)), int(tc["steps"])
    if gb % (ctx.world * accum):
        raise ValueError(f"train.batch_size={gb} must be divisible by ranks x train.accum = {ctx.world} x {accum}")
    train_split = data.splits["train"]
    if tc.get("train_subset"):
        train_split = train_split.subset(int(tc["train_subset"]))
    per_epoch = len(train_split) // gb
    target = tc.get("stop_at_accuracy")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1):
        raise ValueError(f"train.stop_at_accuracy must be a number in (0, 1] or null, got {target!r}")

    torch.manual_seed(int(tc["seed"]))
    model = build_model(config, meta_of(data), attention).to(ctx.device)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=float(tc["lr"]),
        weight_decay=float(tc["weight_decay"]),
        betas=tuple(tc.get("betas", (0.9, 0.999))),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, tc["schedule"], int(tc["warmup"]), steps))
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=tc.get("precision", "fp32") == "fp16")
    step, best, train_seconds, solved_at = 0, -1.0, 0.0, None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        step, best, train_seconds = state["step"], state["best_val"], state["train_seconds"]
        _set_rng_state(state["rng"])
        if target is not None:  # a run that stopped early stays stopped
            solved_at = state.get("solved_at")
    ddp = (
        torch.nn.parallel.DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
        if ctx.world > 1
        else model
    )
    logger = _Logger(run_dir, step, ctx.main, tensorboard)
    precision = tc.get("precision", "fp32")

    def checkpoint(path: Path) -> None:
        if ctx.main:
            save_checkpoint(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "scaler": scaler.state_dict(),
                    "step": step,
                    "best_val": best,
                    "train_seconds": train_seconds,
                    "rng": _rng_state(),
                    "config": config,
                    "attention": attention,
                    "meta": meta_of(data),
                    "world_size": ctx.world,
                    "solved_at": solved_at,
                },
                path,
            )

    def run_eval(split: str) -> dict[str, float]:
        res = evaluate(model, data.splits[split], int(tc["eval_batch_size"]), ctx, precision, tc.get("eval_samples"))
        logger.log(
            {"step": step, "epoch": step / max(per_epoch, 1), "split": split, **res, "train_seconds": train_seconds}
        )
        return res

    bar = tqdm(total=steps, initial=step, disable=not (progress and ctx.main), desc=f"train {attention}")
    started, stopped = time.perf_counter(), False
    window = {"loss": 0.0, "correct": 0.0, "count": 0.0, "samples": 0.0, "seconds": 0.0}
    model.train()
    while step < steps and solved_at is None:
        stop = (stop_after is not None and step >= stop_after) or (
            time_limit is not None and time.perf_counter() - started > time_limit
        )
        if ctx.world > 1 and time_limit is not None:  # all ranks stop together when any one's clock runs out
            stop = ctx.all_sum([float(stop)])[0] > 0
        if stop:
            stopped = True
            break
        tick = time.perf_counter()
        torch.manual_seed(_step_seed(int(tc["seed"]), step, ctx.rank))
        global_idx = batch_indices(len(train_split), gb, int(tc["seed"]), step)
        targets = num_targets(train_split.labels[global_idx])
        idx = global_idx[ctx.rank :: ctx.world]
        opt.zero_grad(set_to_none=True)
        loss_sum = correct = 0.0
        for j, micro in enumerate(idx.chunk(accum)):
            inputs, labels = _batch(train_split, micro, ctx.device)
            sync = ddp.no_sync() if ctx.world > 1 and j < accum - 1 else contextlib.nullcontext()
            with sync:
                with _autocast(ctx.device, precision):
                    logits = ddp(*inputs).float()
                loss, right = scores(logits, labels)
                scaler.scale(loss * (ctx.world / max(targets, 1))).backward()
            loss_sum += float(loss.detach())
            correct += float(right)
        if tc.get("grad_clip"):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(tc["grad_clip"]))
        scaler.step(opt)
        scaler.update()
        sched.step()
        step += 1
        elapsed = time.perf_counter() - tick
        train_seconds += elapsed
        loss_sum, correct = ctx.all_sum([loss_sum, correct])
        for key, value in zip(window, (loss_sum, correct, targets, gb, elapsed)):
            window[key] += value
        bar.update(1)
        if step % int(tc["log_every"]) == 0 or step == steps:
            row = {
                "loss": window["loss"] / window["count"],
                "accuracy": window["correct"] / window["count"],
                "samples_per_s": window["samples"] / max(window["seconds"], 1e-9),
            }
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}", sps=f"{row['samples_per_s']:.1f}")
            logger.log(
                {
                    "step": step,
                    "epoch": step / per_epoch,
                    "split": "train",
                    "lr": sched.get_last_lr()[0],
                    "train_seconds": train_seconds,
                    **row,
                }
            )
            window = dict.fromkeys(window, 0.0)
        if step % int(tc["eval_every"]) == 0 or step == steps:
            res = run_eval("val")
            if res["accuracy"] > best:
                best = res["accuracy"]
                checkpoint(run_dir / BEST)
            if target is not None and res["accuracy"] >= target:
                solved_at = step
        if step % int(tc["checkpoint_every"]) == 0 or step == steps or solved_at is not None:
            checkpoint(run_dir / CHECKPOINT)
    bar.close()
    if stopped:
        checkpoint(run_dir / CHECKPOINT)
    done = step >= steps or solved_at is not None
    summary: dict[str, Any] = {
        "step": step,
        "steps": steps,
        "finished": done,
        "attention": attention,
        "best_val_accuracy": best,
        "train_seconds": train_seconds,
    }
    if solved_at is not None:
        summary["solved_at"] = solved_at
    if done:
        final = run_eval("test")
        summary.update(test_accuracy_last=final["accuracy"], test_samples_per_s=final["samples_per_s"])
        if (run_dir / BEST).exists():
            best_model = load_checkpoint(run_dir / BEST)
            live = model.state_dict()
            model.load_state_dict(best_model["model"])
            if ctx.main:
                save_weights(best_model["model"], run_dir / WEIGHTS, _weights_metadata(best_model))
            summary["test_accuracy_best_val"] = evaluate(
                model, data.splits["test"], int(tc["eval_batch_size"]), ctx, precision
            )["accuracy"]
            model.load_state_dict(live)
    if ctx.main:
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    logger.close()
    return summary


_RUN_KEYS = ("config", "attention", "meta", "step")


def _weights_metadata(state: dict[str, Any]) -> dict[str, str]:
    return {"mita.lra": json.dumps({k: state[k] for k in _RUN_KEYS})}


def read_run_checkpoint(path: str | Path) -> dict[str, Any]:
    """A run's ``checkpoint.pt`` / ``best.pt`` (loaded without running code) or its
    ``model.safetensors``: at least "model", "config", "attention", "meta" and "step"."""
    path = Path(path)
    if path.suffix == ".safetensors":
        weights, metadata = load_weights(path)
        try:
            state = {**json.loads(metadata["mita.lra"]), "model": weights}
        except (KeyError, json.JSONDecodeError):
            raise ValueError(f"{path} holds weights but not the run metadata of mita lra train") from None
    else:
        state = load_checkpoint(path)
    missing = [k for k in ("model", *_RUN_KEYS) if k not in state]
    if missing:
        raise ValueError(f"{path} is not a checkpoint of mita lra train: it lacks {missing}")
    return state


def evaluate_checkpoint(
    path: str | Path,
    data: TaskData,
    attention: Any = None,
    options: dict[str, Any] | None = None,
    split: str = "test",
    batch_size: int | None = None,
    ctx: Dist | None = None,
) -> dict[str, Any]:
    """Accuracy of a checkpoint on ``split``, optionally with another attention (swap) or other
    call-time options such as MiTA's ``num_landmarks`` / ``topk`` / ``num_routed`` (robustness)."""
    path = Path(path)
    if path.is_dir():
        path = path / BEST if (path / BEST).exists() else path / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found; pass a run folder, a .pt or a .safetensors file")
    if split not in data.splits:
        raise ValueError(f"split must be one of {list(data.splits)}, got {split!r}")
    ctx = ctx or init_distributed()
    state = read_run_checkpoint(path)
    if state["meta"] != meta_of(data):
        raise ValueError(f"checkpoint {path} was trained on data {state['meta']}, not {meta_of(data)}")
    used = attention if attention is not None else state["attention"]
    model = build_model(state["config"], state["meta"], used).to(ctx.device)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if options:
        set_attention_options(model, **options)
    tc = state["config"]["train"]
    res = evaluate(
        model, data.splits[split], batch_size or int(tc["eval_batch_size"]), ctx, tc.get("precision", "fp32")
    )
    return {
        "checkpoint": str(path),
        "step": state["step"],
        "trained_with": state["attention"],
        "attention": used,
        "options": options or {},
        "split": split,
        **res,
        "missing_keys": missing,
        "unexpected_keys": unexpected,
    }


def speed(
    config: dict[str, Any],
    meta: dict[str, Any],
    attention: Any,
    lengths: list[int],
    batch_size: int,
    steps: int = 5,
    warmup: int = 1,
    mode: str = "train",
    device: str = "cpu",
) -> Iterator[dict[str, Any]]:
    """Seconds per step (``mode="train"``: forward, backward, optimizer step) or inference
    samples/s (``mode="eval"``) of the config's model on random tokens at each length."""
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    for n in lengths:
        torch.manual_seed(0)
        model = build_model(config, {**meta, "max_length": n}, attention).to(device).train(mode == "train")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(1, meta["vocab_size"], (batch_size, n), device=device)
        pair = [tokens, tokens.flip(0)] if meta["dual"] else [tokens]
        labels = torch.randint(0, meta["num_classes"], (batch_size,), device=device)
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
            if device.startswith("cuda"):
                torch.cuda.synchronize()
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
