"""One trainer for every experiment: the loop, the run folder, exact resume, DDP.

The experiment gives a :class:`Task` (model, data, loss and metrics) and a config; the
trainer owns the rest: the run folder (``config.json`` manifest, ``metrics.csv`` +
``metrics.jsonl`` + TensorBoard, atomic ``checkpoint.pt`` loaded with ``weights_only``,
``best.pt``, final ``model.safetensors``, ``summary.json``, a ``.lock`` against two
writers), AdamW with warm-up and a linear / cosine / constant / rsqrt schedule, gradient
accumulation and clipping, fp32 / bf16 / fp16 autocast, an optional EMA of the weights,
periodic evaluation, early stopping, DDP under ``torchrun``, and exact resume after a
kill -9 (refused, with the reason, when the config, the identity, the data or the number
of processes changed). The unit of progress is the step: the global batch of step t is a
slice of a permutation seeded by (seed, epoch) (:class:`StepSampler`), and every RNG
(torch, CUDA, Python, NumPy) is seeded from (seed, step, rank, micro-batch) before each
fetch and each forward, and saved in the checkpoint. Ctrl-C stops at the end of the step
with a checkpoint (:class:`Interrupted`).

API:

- ``train(task, config, run_dir, *, resume=False, force=False, stop_after=None,
  time_limit=None, progress=True, tensorboard=True, ctx=None) -> summary``
- ``Task(build_model, scores, train_data, eval_data={}, metrics=("accuracy",), identity={},
  fingerprint={}, order=None, collate=None, workers=0, param_groups=None, free_keys=(),
  name="train")``; datasets are map-style: ``len()`` and ``__getitems__(indices) -> batch``
  (a whole batch at once) or ``__getitem__(i) -> sample`` (collated by ``collate``, default
  torch's ``default_collate``); ``workers > 0`` fetches in DataLoader worker processes.
- ``Scores(loss, count, metrics)``: ``loss`` and ``metrics`` summed over ``count`` targets;
  ``classification_scores(logits, labels, ignore_index=-100)`` for cross-entropy + accuracy.
- ``evaluate(model, dataset, scores, batch_size, ctx, precision, max_samples, metrics,
  collate, workers, seed) -> {"loss", *metrics, "samples_per_s"}``
- ``check_train(section) -> section with defaults`` (call it where a config is made),
  ``lr_factor``, ``StepSampler(num_samples, batch_size, seed)``, ``tensor_digest(*tensors)``
- run folders: ``read_manifest(run_dir)``, ``resolve_checkpoint(path)``,
  ``read_checkpoint(path)`` (``.pt`` or ``.safetensors``), ``load_model_state(model, state,
  source)`` (strict, naming missing / unexpected keys and shapes)
- command lines: ``trainer.cli.add_arguments(parser)`` (``--resume --force --stop-after
  --time-limit --no-progress --no-tensorboard --device``), ``trainer.cli.options(args)`` (the
  matching keyword arguments of ``train``) and ``trainer.cli.positive_int`` (an argparse type).

The "train" section (``check_train``): batch_size, steps, lr (required); accum 1, seed 0,
schedule "constant", warmup 0, min_lr 0, weight_decay 0, betas [0.9, 0.999], grad_clip null,
precision "fp32", compile null (or a ``torch.compile`` mode for the training forward:
"default", "reduce-overhead", "max-autotune"), ema null, log_every 10, eval_every 500, checkpoint_every 500,
eval_batch_size null (= batch_size), eval_samples null, train_subset null,
stop_at_accuracy null. Experiment options go in other sections (all of it is recorded and
compared on resume).

Example::

    import torch
    from mita_experiments.trainer import Task, classification_scores, train

    x = torch.randn(512, 8)
    y = (x[:, 0] > 0).long()

    class Data:
        def __init__(self, lo, hi):
            self.lo, self.hi = lo, hi
        def __len__(self):
            return self.hi - self.lo
        def __getitems__(self, indices):
            idx = torch.tensor(indices) + self.lo
            return x[idx], y[idx]

    task = Task(
        build_model=lambda: torch.nn.Linear(8, 2),
        scores=lambda model, batch: classification_scores(model(batch[0]), batch[1]),
        train_data=Data(0, 384),
        eval_data={"val": Data(384, 448), "test": Data(448, 512)},
        identity={"model": "linear"},
    )
    config = {"train": {"batch_size": 32, "steps": 100, "lr": 1e-2, "eval_every": 20}}
    summary = train(task, config, "runs/demo")          # later: train(..., resume=True)
"""

from .config import DEFAULTS, RESUMABLE, SCHEDULES, check_train, lr_factor
from .data import StepSampler, tensor_digest
from .loop import Interrupted, Scores, Task, classification_scores, evaluate, train
from .run import (
    BEST,
    CHECKPOINT,
    MANIFEST,
    METRICS,
    METRICS_JSONL,
    SUMMARY,
    WEIGHTS,
    load_model_state,
    read_checkpoint,
    read_manifest,
    resolve_checkpoint,
    run_attention,
)

__all__ = [
    "BEST",
    "CHECKPOINT",
    "DEFAULTS",
    "MANIFEST",
    "METRICS",
    "METRICS_JSONL",
    "RESUMABLE",
    "SCHEDULES",
    "SUMMARY",
    "WEIGHTS",
    "Interrupted",
    "Scores",
    "StepSampler",
    "Task",
    "check_train",
    "classification_scores",
    "evaluate",
    "load_model_state",
    "lr_factor",
    "read_checkpoint",
    "read_manifest",
    "resolve_checkpoint",
    "run_attention",
    "tensor_digest",
    "train",
]
