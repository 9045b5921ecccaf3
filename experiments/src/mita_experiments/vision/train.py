"""``mita vision train``: the ImageNet-1K recipe for MiTA-DeiT on the shared trainer.

It trains any timm model name (the registered ``mita_deit_*`` ones included) on an ImageFolder
tree (``DATA/train/<class>/*.JPEG``, ``DATA/val/<class>/*.JPEG``) with the DeiT recipe's pieces
from timm (RandAugment, random erasing, Mixup/CutMix, label smoothing, stochastic depth) and
AdamW without weight decay on norms, biases and position embeddings, the learning rate scaled
linearly with the batch (``--lr`` is for 512 images a step), a linear warm-up and a cosine decay
per step. The loop is :mod:`mita_experiments.trainer`'s: the run folder (``config.json``,
``metrics.csv``, ``checkpoint.pt``, ``best.pt``, ``model.safetensors``, ``summary.json``),
evaluation and a checkpoint every epoch, bf16 autocast with ``--amp``, DDP under ``torchrun``
(one process per GPU, NCCL; gloo on CPU) and exact resume (the RNG and data-order state are in the
checkpoint).

The recipe is the flags of :data:`RECIPE` (:func:`add_arguments`); it is checked where it is made
(:func:`recipe`), and ``--resume`` takes the run's own recipe: a flag left out is the run's, a flag
given must be the run's (but ``--epochs``, which may grow).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mita.utils.options import parse_assignments, split_items

from .. import trainer
from ..trainer import cli as trainer_cli
from ..trainer.cli import flag

#: the recipe's flags and their defaults (``--model-args`` as a dict; ``--clip-grad 0``: no clipping)
RECIPE: dict[str, Any] = {
    "model": "mita_deit_small_patch16_224",
    "model_args": {},
    "img_size": 224,
    "epochs": 300,
    "batch_size": 128,
    "lr": 5e-4,
    "weight_decay": 0.05,
    "warmup_epochs": 5,
    "drop_path": 0.1,
    "aa": "rand-m9-mstd0.5-inc1",
    "reprob": 0.25,
    "mixup": 0.8,
    "cutmix": 1.0,
    "smoothing": 0.1,
    "clip_grad": 0.0,
    "amp": False,
    "seed": 0,
}
#: recipe flags a resumed run may change
RESUMABLE = ("epochs",)
MIN_LR = 1e-5  # the floor of the cosine decay (DeiT's)


def _json(value: Any) -> str:
    """``value`` as JSON with sorted keys: how a flag's value compares with the one a run recorded."""
    return json.dumps(value, sort_keys=True)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe flags given on the command line (None: left out), ``--model-args`` as a dict."""
    given = {key: getattr(args, key) for key in RECIPE}
    if given["model_args"] is not None:
        given["model_args"] = parse_assignments(split_items(given["model_args"]), "--model-args")
    return given


def _run_recipe(out: Path, given: dict[str, Any]) -> dict[str, Any] | None:
    """On ``--resume``, the recipe of the run in ``out`` (None if it holds none yet); a ValueError
    names the flags given with other values than the run's."""
    run = trainer_cli.resumed_recipe(out, RECIPE, "mita vision train")
    if run is None:
        return None
    differ = [
        key
        for key, value in given.items()
        if value is not None and key not in RESUMABLE and _json(value) != _json(run[key])
    ]
    if differ:
        was = ", ".join(f"{flag(k)} {_json(run[k])}" for k in differ)
        now = ", ".join(f"{flag(k)} {_json(given[k])}" for k in differ)
        raise ValueError(
            f"--resume: the run in {out} was trained with {was}, not {now}; leave them out to continue it "
            "(a resumed run keeps its recipe), or start a new --out"
        )
    return run


def _check(recipe: dict[str, Any]) -> None:
    """Every number of the recipe in its domain; a ValueError names the flag and what it may be."""
    for key, low in {"img_size": 1, "epochs": 1, "batch_size": 1, "warmup_epochs": 0, "seed": 0}.items():
        value = recipe[key]
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            raise ValueError(f"{flag(key)} must be a whole number >= {low}, got {value!r}")

    def number(key: str, inside: Any, what: str) -> None:
        value = recipe[key]
        if not (isinstance(value, (int, float)) and math.isfinite(value) and inside(value)):
            raise ValueError(f"{flag(key)} must be {what}, got {value!r}")

    number("lr", lambda v: v > 0, "a number > 0")
    number("weight_decay", lambda v: v >= 0, "a number >= 0")
    number("drop_path", lambda v: 0 <= v < 1, "a probability in [0, 1)")
    number("reprob", lambda v: 0 <= v <= 1, "a probability in [0, 1]")
    number("mixup", lambda v: v >= 0, "a Beta alpha >= 0 (0: off)")
    number("cutmix", lambda v: v >= 0, "a Beta alpha >= 0 (0: off)")
    number("smoothing", lambda v: 0 <= v < 1, "a number in [0, 1)")
    number("clip_grad", lambda v: v >= 0, "a gradient norm >= 0 (0: no clipping)")
    if (recipe["mixup"] > 0 or recipe["cutmix"] > 0) and recipe["batch_size"] % 2:
        raise ValueError(
            f"Mixup/CutMix mixes pairs of images: --batch-size must be even, got {recipe['batch_size']} "
            "(or pass --mixup 0 --cutmix 0)"
        )


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The run's recipe from the flags (left out: :data:`RECIPE`'s defaults, or on ``--resume`` the
    run's), checked; before any data is read."""
    given = _given(args)
    run = _run_recipe(Path(args.out), given) if args.resume else None
    base = run if run is not None else RECIPE
    made = {key: base[key] if value is None else value for key, value in given.items()}
    _check(made)
    return made


def _posterize(img: Any, bits_to_keep: int, **kwargs: Any) -> Any:
    """timm's posterize, also for 0 bits kept (a black image, as in the TensorFlow RandAugment).

    With ``inc1`` policies timm 1.0.31 asks for 0 bits at magnitude 10, which its magnitude noise
    (``mstd0.5`` around 9) reaches in about 2% of calls; Pillow 13 refuses 0 bits with a ValueError,
    which would stop a training run at random.
    """
    from PIL import Image
    from timm.data import auto_augment

    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return auto_augment.posterize(img, bits_to_keep, **kwargs)


def train_transform(cfg: dict[str, Any], aa: str | None, reprob: float) -> Any:
    """timm's training transform (RandAugment policy ``aa``, random erasing ``reprob``) for data config ``cfg``."""
    from timm.data import auto_augment, create_transform

    transform = create_transform(**cfg, is_training=True, auto_augment=aa or None, re_prob=reprob)
    for step in getattr(transform, "transforms", ()):
        for op in getattr(step, "ops", ()):
            if op.aug_fn is auto_augment.posterize:
                op.aug_fn = _posterize
    return transform


def _files_digest(dataset: Any) -> str:
    """A SHA-256 of an ImageFolder's files (paths under its root) and labels: its data, checked on resume."""
    h = hashlib.sha256()
    for path, label in dataset.samples:
        h.update(f"{Path(path).relative_to(dataset.root)}\t{label}\n".encode())
    return h.hexdigest()


class Scores:
    """The summed loss and the number right (top-1) of a batch.

    In training with Mixup/CutMix: the soft-target cross-entropy of the mixed images (their
    targets label-smoothed by timm's ``Mixup``), top-1 against the unmixed labels; in training
    without them: cross-entropy with label smoothing; in evaluation: plain cross-entropy.
    """

    def __init__(self, mixup: Any, smoothing: float) -> None:
        self.mixup, self.smoothing = mixup, smoothing

    def __call__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> trainer.Scores:
        images, labels = batch
        if model.training and self.mixup is not None:
            mixed, soft = self.mixup(images, labels)
            logits = model(mixed).float()
            loss = -(soft * F.log_softmax(logits, -1)).sum()
        else:
            logits = model(images).float()
            smoothing = self.smoothing if model.training else 0.0
            loss = F.cross_entropy(logits, labels, label_smoothing=smoothing, reduction="sum")
        return trainer.Scores(loss, len(labels), {"top1": (logits.detach().argmax(-1) == labels).sum()})


def training(recipe: dict[str, Any], data: Path, workers: int, world: int) -> tuple[trainer.Task, dict[str, Any]]:
    """The trainer's task and config of a checked ``recipe`` on the ImageFolder tree ``data``, with
    ``workers`` loading processes per rank and ``world`` ranks of ``--batch-size`` images each."""
    import timm
    from timm.data import Mixup, create_transform, resolve_data_config
    from timm.optim import param_groups_weight_decay
    from torchvision.datasets import ImageFolder

    from mita.models.deit import register_models

    for split in ("train", "val"):
        if not (data / split).is_dir():
            raise FileNotFoundError(f"--data {data} needs an ImageFolder tree with {split}/<class>/<images>")
    register_models()
    if not timm.is_model(recipe["model"]):
        raise ValueError(f"--model {recipe['model']!r} is not a timm model name")
    val_set = ImageFolder(data / "val")
    options = {
        "num_classes": len(val_set.classes),
        "drop_path_rate": recipe["drop_path"],
        "img_size": recipe["img_size"],
        **recipe["model_args"],
    }

    def build() -> torch.nn.Module:
        return timm.create_model(recipe["model"], **options)

    try:
        with torch.device("meta"):  # the options checked, no memory
            model = build()
    except TypeError as err:
        raise ValueError(f"--model {recipe['model']} --model-args {recipe['model_args']}: {err}") from None
    cfg = resolve_data_config({"input_size": (3, recipe["img_size"], recipe["img_size"])}, model=model)
    val_set.transform = create_transform(**cfg)
    train_set = ImageFolder(data / "train", train_transform(cfg, recipe["aa"], recipe["reprob"]))
    if train_set.classes != val_set.classes:
        raise ValueError(f"--data {data}: the train and val classes differ ({train_set.classes} vs {val_set.classes})")
    batch = recipe["batch_size"] * world
    per_epoch = len(train_set) // batch
    if per_epoch < 1:
        raise ValueError(
            f"--batch-size {recipe['batch_size']} x {world} process(es) = {batch} exceeds the {len(train_set)} "
            "training images; lower --batch-size"
        )
    lr = recipe["lr"] * batch / 512  # DeiT's linear scaling rule
    train = {
        "batch_size": batch,
        "steps": recipe["epochs"] * per_epoch,
        "lr": lr,
        "schedule": "cosine",
        "warmup": recipe["warmup_epochs"] * per_epoch,
        "min_lr": min(MIN_LR, lr),
        "weight_decay": recipe["weight_decay"],
        "grad_clip": recipe["clip_grad"],
        "precision": "bf16" if recipe["amp"] else "fp32",
        "seed": recipe["seed"],
        "eval_every": per_epoch,
        "checkpoint_every": per_epoch,
        "eval_batch_size": recipe["batch_size"],
    }
    mixup = None
    if recipe["mixup"] > 0 or recipe["cutmix"] > 0:
        mixup = Mixup(
            mixup_alpha=recipe["mixup"],
            cutmix_alpha=recipe["cutmix"],
            label_smoothing=recipe["smoothing"],
            num_classes=len(val_set.classes),
        )
    task = trainer.Task(
        build_model=build,
        scores=Scores(mixup, recipe["smoothing"]),
        train_data=train_set,
        eval_data={"val": val_set},
        metrics=("top1",),
        identity={"model": recipe["model"]},
        fingerprint={
            name: {"images": len(ds), "classes": ds.classes, "files": _files_digest(ds)}
            for name, ds in (("train", train_set), ("val", val_set))
        },
        workers=workers,
        param_groups=lambda m: param_groups_weight_decay(
            m, recipe["weight_decay"], no_weight_decay_list=getattr(m, "no_weight_decay", set)()
        ),
        free_keys=tuple(f"recipe.{key}" for key in RESUMABLE),
        name=f"train {recipe['model']}",
    )
    return task, {"train": train, "recipe": recipe}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mita vision train`` but ``--out``: the data, the recipe (:data:`RECIPE`; left out:
    its default, or on ``--resume`` the run's), the loading processes and the trainer's flags."""
    helps = {
        "model": "any timm model name",
        "model_args": "extra create_model options, e.g. 'num_landmarks=25,topk=25,compat=official'",
        "img_size": "image size in pixels",
        "epochs": "epochs (on --resume it may grow)",
        "batch_size": "images a step per process (DeiT: 8 GPUs x 128 = 1024)",
        "lr": "learning rate for 512 images a step, scaled linearly with the batch",
        "weight_decay": "AdamW weight decay (none on norms, biases and position embeddings)",
        "warmup_epochs": "epochs of linear warm-up",
        "drop_path": "stochastic depth rate",
        "aa": "timm auto-augment policy ('' for none)",
        "reprob": "random erasing probability",
        "mixup": "Mixup alpha (0: off)",
        "cutmix": "CutMix alpha (0: off)",
        "smoothing": "label smoothing",
        "clip_grad": "largest gradient norm (0: no clipping)",
        "amp": "bfloat16 autocast",
        "seed": "seed of the initialisation, the data order and every random draw",
    }
    trainer_cli.add_recipe_arguments(
        p, "folder with train/<class>/... and val/<class>/...", RECIPE, helps, workers=8, shown={"model_args": "none"}
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train (or ``--resume``, or ``--force`` start over) the run in ``--out``; its summary, also
    printed by rank 0 and written to ``OUT/summary.json``."""
    return trainer_cli.run_recipe(args, recipe(args), training)
