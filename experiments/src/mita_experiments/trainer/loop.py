"""The training loop: one process or several under ``torchrun`` (DDP), resumable exactly."""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..utils.checkpoint import load_checkpoint, save_checkpoint, save_weights
from ..utils.distributed import Dist, init_distributed
from ..utils.files import atomic_write_text, lock_folder
from . import run as rf
from .config import RESUMABLE, check_train, lr_factor
from .data import EVAL, FETCH, FORWARD, StepSampler, derive_seed, fetch_all, reseed, shard, to_device

__all__ = ["Interrupted", "Scores", "Task", "classification_scores", "evaluate", "train"]


@dataclass
class Scores:
    """What a batch scored: ``loss`` summed over its ``count`` targets (with its graph in
    training), and ``metrics`` summed over the same targets (e.g. {"accuracy": number correct}).
    The trainer divides every sum by the global batch's count, so any split over ranks and
    micro-batches gives the same update and the same logged means."""

    loss: torch.Tensor
    count: float | torch.Tensor
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)


def classification_scores(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> Scores:
    """Summed cross-entropy and number correct ("accuracy") of ``logits`` (B, C) or (B, N, C)
    against integer ``labels`` (B,) or (B, N); entries equal to ``ignore_index`` take no part."""
    logits, labels = logits.float().flatten(0, -2), labels.flatten()
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    keep = labels != ignore_index
    correct = ((logits.detach().argmax(-1) == labels) & keep).sum()
    return Scores(loss, keep.sum(), {"accuracy": correct})


@dataclass
class Task:
    """What an experiment gives the trainer.

    Args:
        build_model: makes the model (called after the RNGs are seeded with ``train.seed``).
        scores: ``scores(model, batch) -> Scores`` for a batch already on the device, run
            under the trainer's autocast; in training ``model`` may be the DDP wrapper or
            (train.compile) the compiled module.
        train_data: a map-style dataset: ``len()`` and ``__getitems__(indices) -> batch``, or
            ``__getitem__(i) -> sample`` with ``collate``.
        eval_data: named evaluation datasets (same protocol): "val" is evaluated every
            ``train.eval_every`` steps and selects ``best.pt``, "test" at the end (default none).
        metrics: the names of ``Scores.metrics``, in log-column order; the first selects
            ``best.pt`` and is the one ``train.stop_at_accuracy`` reads (default ("accuracy",)).
        identity: what the run is besides its config (e.g. {"attention": "sdpa"}); recorded
            in the manifest, checkpoints and summary; a resume with another value is refused.
        fingerprint: what identifies the data (sizes, content hashes); recorded, and a resume
            on other data is refused naming what differs (default: nothing checked).
        order: ``order(step) -> indices`` of the global batch of ``step`` (default: a
            :class:`~mita_experiments.trainer.data.StepSampler` seeded by ``train.seed``).
        collate: turns a list of samples (or what ``__getitems__`` returns) into a batch.
        workers: DataLoader worker processes that fetch batches (default 0: in this process).
        param_groups: ``param_groups(model)`` for the optimizer, e.g. no weight decay on
            norms and biases (default: all parameters alike).
        free_keys: dotted prefixes of config keys a resumed run may change besides
            :data:`~mita_experiments.trainer.config.RESUMABLE` (e.g. ("data.generate",)).
        name: the progress bar's label (default "train").
    """

    build_model: Callable[[], torch.nn.Module]
    scores: Callable[[torch.nn.Module, Any], Scores]
    train_data: Any
    eval_data: Mapping[str, Any] = field(default_factory=dict)
    metrics: tuple[str, ...] = ("accuracy",)
    identity: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    order: Callable[[int], torch.Tensor] | None = None
    collate: Callable[[Any], Any] | None = None
    workers: int = 0
    param_groups: Callable[[torch.nn.Module], Any] | None = None
    free_keys: tuple[str, ...] = ()
    name: str = "train"


class Interrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C (SIGINT) at a step boundary, after saving a checkpoint."""


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _keys(indices: torch.Tensor, batch_size: int, *seed_parts: int) -> Callable[[], Iterator[tuple[int, list[int]]]]:
    return lambda: (
        (derive_seed(*seed_parts, lo), indices[lo : lo + batch_size].tolist())
        for lo in range(0, len(indices), batch_size)
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Any,
    scores: Callable[[torch.nn.Module, Any], Scores],
    batch_size: int,
    ctx: Dist | None = None,
    precision: str = "fp32",
    max_samples: int | None = None,
    metrics: tuple[str, ...] = ("accuracy",),
    collate: Callable[[Any], Any] | None = None,
    workers: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """Mean loss and ``metrics`` per target, and throughput (samples/s), of ``model`` on ``dataset``.

    Args:
        model: evaluated in eval mode (its mode is restored after).
        dataset: a dataset as :class:`Task`'s ``eval_data``; sharded over the ranks of ``ctx``.
        scores: as :class:`Task`'s.
        batch_size: samples per forward (per rank).
        ctx: the process's place in a DDP run (default: one process on the CPU).
        precision: "fp32", "bf16" or "fp16" autocast (default "fp32").
        max_samples: evaluate the first this many samples (default: all).
        metrics: the names of ``Scores.metrics`` to report (default ("accuracy",)).
        collate: as :class:`Task`'s ``collate``.
        workers: as :class:`Task`'s ``workers``.
        seed: seeds the RNGs before each batch is fetched (default 0).
    """
    ctx = ctx or Dist()
    n = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    if n == 0:
        raise ValueError("cannot evaluate on an empty split")
    was_training = model.training
    model.eval()
    idx = torch.arange(ctx.rank, n, ctx.world)
    sums = dict.fromkeys(["loss", "count", *metrics, "seconds"], 0.0)
    batches = fetch_all(
        dataset, _keys(idx, batch_size, EVAL, seed, ctx.rank), collate, workers, ctx.device.type == "cuda"
    )
    for _, batch in batches:
        batch = to_device(batch, ctx.device)
        start = time.perf_counter()
        with _autocast(ctx.device, precision):
            s = scores(model, batch)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        sums["seconds"] += time.perf_counter() - start
        sums["loss"] += float(s.loss)
        sums["count"] += float(s.count)
        for m in metrics:
            sums[m] += float(s.metrics[m])
    totals = dict(zip(sums, ctx.all_sum(list(sums.values()))))
    model.train(was_training)
    count = max(totals["count"], 1.0)
    return {
        "loss": totals["loss"] / count,
        **{m: totals[m] / count for m in metrics},
        "samples_per_s": n / max(totals["seconds"] / ctx.world, 1e-9),
    }


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
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x))  # tuples and lists compare equal after this


def _changed(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if _json(old) == _json(new) else [prefix.rstrip(".") or "the value"]
    return [k for key in sorted(set(old) | set(new)) for k in _changed(old.get(key), new.get(key), f"{prefix}{key}.")]


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_resume(state: dict[str, Any], config: dict[str, Any], task: Task, ctx: Dist) -> list[str]:
    """Refuse what a resumed run may not change; returns the config keys that did change."""
    if state.get("format") != rf.FORMAT:
        raise ValueError(f"--resume: {rf.CHECKPOINT} was written by another version of the trainer; start a new --out")
    if state["world_size"] != ctx.world:
        raise ValueError(
            f"--resume: the run was trained by {state['world_size']} process(es) and this is {ctx.world}: resume it "
            f"with the same number (torchrun --nproc_per_node {state['world_size']}, or no torchrun for 1); the "
            "batches' split over ranks and the random streams depend on it, so another number would not continue "
            "the run exactly"
        )
    identity = _json(dict(task.identity))
    for key in sorted(set(state["identity"]) | set(identity)):
        old, new = state["identity"].get(key), identity.get(key)
        if _json(old) != new:
            raise ValueError(
                f"--resume: the run's {key} is {old!r}, not {new!r}; the {key} cannot change on resume "
                "(start a new --out for another)"
            )
    differ = _changed(state["data"], _json(dict(task.fingerprint)))
    if differ:
        new = _json(dict(task.fingerprint))
        what = ", ".join(f"{k} ({_short(_get(state['data'], k))} -> {_short(_get(new, k))})" for k in differ)
        raise ValueError(
            f"--resume: this is not the data the run was trained on: {what}; pass the run's data or start a new --out"
        )
    changed = [k for k in _changed(state["config"], config) if not k.startswith(task.free_keys)]
    frozen = [k for k in changed if not (k.startswith("train.") and k.split(".", 1)[1] in RESUMABLE)]
    if frozen:
        was = ", ".join(f"{k}: {_get(state['config'], k)!r} -> {_get(config, k)!r}" for k in frozen)
        allowed = ", ".join(f"train.{k}" for k in RESUMABLE)
        raise ValueError(f"--resume cannot change {was}; only {allowed} may change (start a new --out for the rest)")
    return changed


@contextlib.contextmanager
def _sigint_flag() -> Iterator[dict[str, bool]]:
    """A flag set by the first Ctrl-C (the loop stops at the next step boundary); a second one
    raises KeyboardInterrupt at once."""
    flag = {"set": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        flag["set"] = True
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def train(
    task: Task,
    config: Mapping[str, Any],
    run_dir: str | Path,
    *,
    resume: bool = False,
    force: bool = False,
    stop_after: int | None = None,
    time_limit: float | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    ctx: Dist | None = None,
) -> dict[str, Any]:
    """Train (or resume) ``task`` in ``run_dir``; returns the run's summary (also ``summary.json``).

    Args:
        task: the experiment (:class:`Task`).
        config: the whole configuration (recorded; on resume only the train keys of
            :data:`~mita_experiments.trainer.config.RESUMABLE` and ``task.free_keys`` may
            change); its "train" section is the trainer's (:func:`~mita_experiments.trainer.config.check_train`).
        run_dir: the run folder (:mod:`mita_experiments.trainer.run`).
        resume: continue from ``run_dir/checkpoint.pt``; a folder without one starts at step 0.
            A finished run is left unchanged (its summary returned) unless ``train.steps`` grew.
        force: start over in a folder holding a run or other files (run files replaced, other files kept).
        stop_after: stop with a checkpoint once this many steps are done (default: never).
        time_limit: stop with a checkpoint after this many seconds of this call (default: never).
        progress: show a progress bar (default True).
        tensorboard: also write TensorBoard logs (default True).
        ctx: this process's place in a DDP run (default: :func:`~mita_experiments.utils.distributed.init_distributed`).

    Ctrl-C stops at the end of the step with a checkpoint and raises :class:`Interrupted`.
    """
    from tqdm import tqdm

    ctx = ctx or init_distributed()
    run_dir = Path(run_dir)
    if "train" not in config:
        raise ValueError("the config has no 'train' section")
    config = _json({**config, "train": check_train(config["train"])})
    tc = config["train"]
    gb, accum, steps, seed, precision = tc["batch_size"], tc["accum"], tc["steps"], tc["seed"], tc["precision"]
    if gb % (ctx.world * accum):
        raise ValueError(f"train.batch_size={gb} must be divisible by ranks x train.accum = {ctx.world} x {accum}")
    if precision == "fp16" and ctx.device.type != "cuda":
        raise ValueError("train.precision='fp16' needs a CUDA device; use 'bf16' or 'fp32' on the CPU")
    for name, split in task.eval_data.items():
        if len(split) == 0:
            raise ValueError(f"the {name} split is empty: nothing to evaluate on; give data with {name} samples")
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be >= 1, got {stop_after}")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds, got {time_limit}")
    n_train = len(task.train_data) if tc["train_subset"] is None else min(len(task.train_data), tc["train_subset"])
    order = task.order or StepSampler(n_train, gb, seed)
    per_epoch = getattr(order, "steps_per_epoch", n_train / gb)
    select = task.metrics[0]
    eval_bs = tc["eval_batch_size"] or gb

    with contextlib.ExitStack() as held:

        def claim() -> bool:
            resuming = rf.prepare(run_dir, resume, force)
            run_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(lock_folder(run_dir, "a run"))
            rf.claim(run_dir, resuming, force)
            if resume and not resuming:
                print(f"--resume: no {rf.CHECKPOINT} in {run_dir} yet: the run starts from step 0", file=sys.stderr)
            return resuming

        state = load_checkpoint(run_dir / rf.CHECKPOINT) if ctx.on_main(claim) else None
        changed: list[str] = []
        target = tc["stop_at_accuracy"]
        if state is not None:
            changed = _check_resume(state, config, task, ctx)
            solved = state["solved_at"] is not None and target is not None
            if state["finished"] and (solved or steps <= state["step"]):
                if ctx.main:
                    print(
                        f"the run in {run_dir} is finished (step {state['step']}): nothing to do "
                        "(raise train.steps to train it further)",
                        file=sys.stderr,
                    )
                    if not (run_dir / rf.SUMMARY).exists():
                        atomic_write_text(run_dir / rf.SUMMARY, json.dumps(state["summary"], indent=2))
                return state["summary"]
            if steps < state["step"]:
                raise ValueError(f"train.steps={steps} is below the run's step {state['step']}; give more steps")
            if changed and ctx.main:
                print(f"--resume: changed {', '.join(changed)}", file=sys.stderr)
        if ctx.main and (state is None or changed):
            manifest = {"config": config, "identity": dict(task.identity), "data": dict(task.fingerprint)}
            atomic_write_text(run_dir / rf.MANIFEST, json.dumps(_json(manifest), indent=2))

        reseed(seed)
        model = task.build_model().to(ctx.device)
        params = task.param_groups(model) if task.param_groups is not None else model.parameters()
        opt = torch.optim.AdamW(params, lr=tc["lr"], weight_decay=tc["weight_decay"], betas=tuple(tc["betas"]))
        floor = tc["min_lr"] / tc["lr"]
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, tc["schedule"], tc["warmup"], steps, floor)
        )
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=precision == "fp16")
        ema = None
        if tc["ema"] is not None:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(tc["ema"]), use_buffers=True)
        eval_model = ema.module if ema is not None else model
        step, best, train_seconds, solved_at, finished = 0, -math.inf, 0.0, None, False
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            if ema is not None:
                ema.load_state_dict(state["ema"])
            step, best, train_seconds = state["step"], state["best"], state["train_seconds"]
            finished = state["finished"]
            solved_at = state["solved_at"] if target is not None else None
            _set_rng_state(state["rng"])
        saved_step = step if state is not None else None
        ddp = (
            torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None
            )
            if ctx.world > 1
            else model
        )
        # train.compile: the training forward (and its backward) by torch.compile; the weights, checkpoints and
        # evaluation stay those of the eager module. "reduce-overhead" replays CUDA graphs, which is what takes
        # away the host's launch cost of MiTA's small ops on a GPU (docs/performance.md).
        forward = ddp if tc["compile"] is None else torch.compile(ddp, mode=tc["compile"])
        fields = ["step", "epoch", "split", "loss", *task.metrics, "lr", "samples_per_s", "train_seconds"]
        logger = rf.Logger(run_dir, fields, step, finished, ctx.main, tensorboard)
        held.callback(logger.close)
        describe = {"config": config, "identity": _json(dict(task.identity)), "data": _json(dict(task.fingerprint))}

        def save(path: Path, finished: bool = False, summary: dict[str, Any] | None = None) -> None:
            if ctx.main:
                save_checkpoint(
                    {
                        "format": rf.FORMAT,
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "scaler": scaler.state_dict(),
                        "ema": ema.state_dict() if ema is not None else None,
                        "step": step,
                        "best": best,
                        "train_seconds": train_seconds,
                        "rng": _rng_state(),
                        "world_size": ctx.world,
                        "solved_at": solved_at,
                        "finished": finished,
                        "summary": summary,
                        **describe,
                    },
                    path,
                )

        def run_eval(split: str) -> dict[str, float]:
            res = evaluate(
                eval_model,
                task.eval_data[split],
                task.scores,
                eval_bs,
                ctx,
                precision,
                tc["eval_samples"] if split == "val" else None,
                task.metrics,
                task.collate,
                task.workers,
                seed,
            )
            row = {"step": step, "epoch": step / per_epoch, "split": split, **res, "train_seconds": train_seconds}
            logger.log(row)
            return res

        first = step

        def micro_keys() -> Iterator[tuple[int, list[int]]]:
            for s in range(first, steps):
                for j, micro in enumerate(shard(order(s), ctx.rank, ctx.world, accum)):
                    yield derive_seed(FETCH, seed, s, ctx.rank, j), micro.tolist()

        batches = fetch_all(task.train_data, micro_keys, task.collate, task.workers, ctx.device.type == "cuda")
        held.callback(batches.close)
        grads = [p for group in opt.param_groups for p in group["params"]]
        bar = tqdm(total=steps, initial=step, disable=not (progress and ctx.main), desc=f"{task.name}")
        held.callback(bar.close)
        sigint = contextlib.ExitStack()  # Ctrl-C stops at a step boundary during the loop only
        held.callback(sigint.close)
        interrupt = sigint.enter_context(_sigint_flag())
        started, stopped = time.perf_counter(), False
        window = dict.fromkeys(["loss", "count", *task.metrics, "samples", "seconds"], 0.0)
        model.train()
        while step < steps and solved_at is None:
            stop = (
                (stop_after is not None and step >= stop_after)
                or (time_limit is not None and time.perf_counter() - started > time_limit)
                or interrupt["set"]
            )
            if ctx.world > 1:  # all ranks stop together when any one must
                stop = ctx.all_sum([float(stop)])[0] > 0
            if stop:
                stopped = True
                break
            tick = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            sums = dict.fromkeys(["loss", "count", *task.metrics, "samples"], 0.0)
            for j in range(accum):
                size, batch = next(batches)
                batch = to_device(batch, ctx.device)
                reseed(derive_seed(FORWARD, seed, step, ctx.rank, j))
                sync = ddp.no_sync() if ctx.world > 1 and j < accum - 1 else contextlib.nullcontext()
                with sync:
                    if tc["compile"] == "reduce-overhead":
                        torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are not read again
                    with _autocast(ctx.device, precision):
                        s = task.scores(forward, batch)
                    scaler.scale(s.loss).backward()
                sums["loss"] += float(s.loss.detach())
                sums["count"] += float(s.count)
                sums["samples"] += size
                for m in task.metrics:
                    sums[m] += float(s.metrics[m])
            totals = dict(zip(sums, ctx.all_sum(list(sums.values()))))
            if not math.isfinite(totals["loss"]) and precision != "fp16":
                raise ValueError(
                    f"the training loss is {totals['loss']} at step {step + 1}; {rf.CHECKPOINT} keeps the last saved "
                    "step: lower train.lr, set train.grad_clip or check the data"
                )
            factor = ctx.world / max(totals["count"], 1.0)  # DDP averaged over ranks; the loss is a sum
            for p in grads:
                if p.grad is not None:
                    p.grad.mul_(factor)
            if tc["grad_clip"]:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc["grad_clip"])
            scaler.step(opt)
            scaler.update()
            sched.step()
            if ema is not None:
                ema.update_parameters(model)
            step += 1
            elapsed = time.perf_counter() - tick
            train_seconds += elapsed
            for key in sums:
                window[key] += totals[key]
            window["seconds"] += elapsed
            bar.update(1)
            if step % tc["log_every"] == 0 or step == steps:
                count = max(window["count"], 1.0)
                row = {
                    "loss": window["loss"] / count,
                    **{m: window[m] / count for m in task.metrics},
                    "samples_per_s": window["samples"] / max(window["seconds"], 1e-9),
                }
                bar.set_postfix({k: f"{v:.3g}" for k, v in row.items()})
                logger.log(
                    {
                        "step": step,
                        "epoch": step / per_epoch,
                        "split": "train",
                        **row,
                        "lr": sched.get_last_lr()[0],
                        "train_seconds": train_seconds,
                    }
                )
                window = dict.fromkeys(window, 0.0)
            if "val" in task.eval_data and (step % tc["eval_every"] == 0 or step == steps):
                res = run_eval("val")
                if res[select] > best:
                    best = res[select]
                    if ctx.main:
                        save_checkpoint(
                            {"format": rf.FORMAT, "model": eval_model.state_dict(), **describe, "step": step},
                            run_dir / rf.BEST,
                        )
                if target is not None and res[select] >= target:
                    solved_at = step
            if step % tc["checkpoint_every"] == 0 or step == steps or solved_at is not None:
                save(run_dir / rf.CHECKPOINT)
                saved_step = step
        bar.close()
        sigint.close()
        if stopped and saved_step != step:
            save(run_dir / rf.CHECKPOINT)
        if interrupt["set"]:
            raise Interrupted(f"interrupted at step {step}: {run_dir / rf.CHECKPOINT} saved; continue with --resume")
        done = step >= steps or solved_at is not None
        summary: dict[str, Any] = {"step": step, "steps": steps, "finished": done, **_json(dict(task.identity))}
        if best > -math.inf:
            summary[f"best_val_{select}"] = best
        summary["train_seconds"] = train_seconds
        if solved_at is not None:
            summary["solved_at"] = solved_at
        if done:
            if "test" in task.eval_data:
                final = run_eval("test")
                summary.update({f"test_{m}_last": final[m] for m in task.metrics})
                summary["test_samples_per_s"] = final["samples_per_s"]
            weights, weights_step = eval_model.state_dict(), step
            if best > -math.inf:
                live = {k: v.clone() for k, v in weights.items()}
                ctx.barrier()  # rank 0 wrote best.pt; every rank reads it
                best_state = load_checkpoint(run_dir / rf.BEST)
                weights, weights_step = best_state["model"], best_state["step"]
                eval_model.load_state_dict(weights)
                if "test" in task.eval_data:
                    final = evaluate(
                        eval_model,
                        task.eval_data["test"],
                        task.scores,
                        eval_bs,
                        ctx,
                        precision,
                        None,
                        task.metrics,
                        task.collate,
                        task.workers,
                        seed,
                    )
                    summary.update({f"test_{m}_best_val": final[m] for m in task.metrics})
                eval_model.load_state_dict(live)
            if ctx.main:
                save_weights(weights, run_dir / rf.WEIGHTS, rf.weights_metadata({**describe, "step": weights_step}))
            save(run_dir / rf.CHECKPOINT, finished=True, summary=summary)
        if ctx.main:
            atomic_write_text(run_dir / rf.SUMMARY, json.dumps(summary, indent=2))
        return summary
