"""``mita seg train`` and ``mita seg eval``: Segmenter on ADE20K with the shared trainer.

The recipe (:data:`RECIPE`) follows the MiTA authors' Segmenter runs (512 px crops, batch 8, 64
epochs, sliding-window evaluation with window 512 and stride 512, MiTA m = k = 49 in every encoder
block) on the trainer's optimizer: AdamW with a linear decay (Segmenter uses SGD with a polynomial
decay, which the trainer does not offer). The encoder starts from ``--init`` (timm ViT weights,
e.g. ImageNet-21k ``augreg`` ones saved beforehand; nothing is downloaded) or at random. The run
folder, periodic evaluation (loss and pixel accuracy on ``--val-images`` validation images), CSV
and TensorBoard logs, checkpoints, exact resume, safetensors weights, DDP under ``torchrun`` and
bf16 autocast are the trainer's; at the end, rank 0 writes ``miou.json``: mIoU, pixel accuracy and
per-class IoU of the final weights over the whole validation split.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from .. import trainer
from ..trainer import cli as trainer_cli
from ..trainer.cli import flag
from ..utils.checkpoint import load_checkpoint, load_weights
from ..utils.distributed import Dist
from ..utils.files import atomic_write_text
from .ade20k import ADE20K, NUM_CLASSES, EvalTransform, TrainTransform
from .task import SegmentationScores, evaluate_miou

#: the recipe's flags and their defaults
RECIPE: dict[str, Any] = {
    "size": "tiny",
    "decoder": "mask_transformer",
    "attention": "mita:num_landmarks=49,topk=49",  # mita.models.segmenter.DEFAULT_ATTENTION (no timm import here)
    "decoder_attention": "sdpa",
    "decoder_depth": 2,
    "init": None,
    "crop": 512,
    "epochs": 64,
    "batch_size": 8,
    "lr": 1e-4,
    "weight_decay": 0.01,
    "drop_path": 0.1,
    "window": 512,
    "stride": 512,
    "eval_epochs": 2,
    "val_images": 500,
    "amp": False,
    "seed": 0,
}
MIOU = "miou.json"


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The run's recipe: the flags given, the rest :data:`RECIPE`'s defaults or on ``--resume`` the run's
    (the trainer refuses a resume whose recipe differs, naming the keys); checked before any data is read."""
    run = trainer_cli.resumed_recipe(Path(args.out), RECIPE, "mita seg train") if args.resume else None
    base = RECIPE if run is None else run
    made = {key: base[key] if getattr(args, key) is None else getattr(args, key) for key in RECIPE}
    from mita.models.segmenter import SIZES

    if made["size"] not in SIZES:
        raise ValueError(f"--size must be one of {list(SIZES)}, got {made['size']!r}")
    for key in ("decoder_depth", "crop", "epochs", "batch_size", "window", "stride", "eval_epochs", "val_images"):
        if not (isinstance(made[key], int) and made[key] >= 1):
            raise ValueError(f"{flag(key)} must be a whole number >= 1, got {made[key]!r}")
    if not (math.isfinite(made["lr"]) and made["lr"] > 0):
        raise ValueError(f"--lr must be a number > 0, got {made['lr']!r}")
    if not (math.isfinite(made["weight_decay"]) and made["weight_decay"] >= 0):
        raise ValueError(f"--weight-decay must be a number >= 0, got {made['weight_decay']!r}")
    if not 0 <= made["drop_path"] < 1:
        raise ValueError(f"--drop-path must be in [0, 1), got {made['drop_path']!r}")
    return made


def build_model(made: dict[str, Any]) -> torch.nn.Module:
    """The recipe's Segmenter for ADE20K's 150 classes (the encoder from ``init`` when given)."""
    from mita.models.segmenter import create_segmenter

    model = create_segmenter(
        made["size"],
        num_classes=NUM_CLASSES,
        img_size=made["crop"],
        decoder=made["decoder"],
        attention=made["attention"],
        decoder_attention=made["decoder_attention"],
        decoder_depth=made["decoder_depth"],
        drop_path_rate=made["drop_path"],
    )
    if made["init"]:
        load_encoder(model, made["init"])
    return model


def load_encoder(model: torch.nn.Module, path: str | Path) -> None:
    """timm ViT weights (safetensors, or a ``.pth`` / ``.pt`` state dict, loaded without running code) into the
    Segmenter's encoder: the classifier head dropped, the position embeddings resampled to its patch grid."""
    from timm.layers import resample_abs_pos_embed

    path = Path(path)
    state = load_weights(path)[0] if path.suffix == ".safetensors" else load_checkpoint(path, "--init weights")
    state = state.get("model", state) if isinstance(state.get("model"), dict) else state
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    encoder = model.encoder
    if "pos_embed" in state and state["pos_embed"].shape != encoder.pos_embed.shape:
        state["pos_embed"] = resample_abs_pos_embed(
            state["pos_embed"], list(encoder.patch_embed.grid_size), num_prefix_tokens=encoder.num_prefix_tokens
        )
    trainer.load_model_state(encoder, state, path)


def training(made: dict[str, Any], data: Path, workers: int, world: int) -> tuple[trainer.Task, dict[str, Any]]:
    """The trainer's task and config of a checked recipe on the ADE20K release at ``data``."""
    train_set = ADE20K(data, "training", TrainTransform(crop=made["crop"]))
    evaluation = EvalTransform(scale=(4 * made["crop"], made["crop"]))
    val_set = ADE20K(data, "validation", evaluation, limit=made["val_images"])
    splits = {"train": train_set, "val": val_set}
    batch = made["batch_size"] * world
    per_epoch = len(train_set) // batch
    if per_epoch < 1:
        raise ValueError(
            f"--batch-size {made['batch_size']} x {world} process(es) exceeds the {len(train_set)} training images"
        )
    train = {
        "batch_size": batch,
        "steps": made["epochs"] * per_epoch,
        "lr": made["lr"],
        "schedule": "linear",
        "weight_decay": made["weight_decay"],
        "precision": "bf16" if made["amp"] else "fp32",
        "seed": made["seed"],
        "log_every": max(1, min(50, per_epoch)),
        "eval_every": made["eval_epochs"] * per_epoch,
        "checkpoint_every": per_epoch,
        "eval_batch_size": 1,  # validation images differ in size
    }
    task = trainer.Task(
        build_model=lambda: build_model(made),
        scores=SegmentationScores(made["window"], made["stride"]),
        train_data=train_set,
        eval_data={"val": val_set},
        identity={"model": f"segmenter-{made['size']}", "attention": made["attention"]},
        fingerprint={name: {"images": len(ds), "files": ds.digest()} for name, ds in splits.items()},
        workers=workers,
        param_groups=lambda m: _param_groups(m, made["weight_decay"]),
        free_keys=("recipe.epochs",),
        name=f"segmenter-{made['size']} {made['attention']}",
    )
    return task, {"train": train, "recipe": made}


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """No weight decay on norms, biases, position embeddings and class embeddings (timm's and Segmenter's rule)."""
    from timm.optim import param_groups_weight_decay

    return param_groups_weight_decay(model, weight_decay, no_weight_decay_list=model.no_weight_decay())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``mita seg train``: train (or ``--resume``, or ``--force`` start over) the run in ``--out``; its summary,
    and on a finished run ``miou.json``."""
    made = recipe(args)

    def finish(summary: dict[str, Any], ctx: Dist) -> None:
        if not summary.get("finished"):
            return
        model = build_model({**made, "init": None}).to(ctx.device)
        weights = Path(args.out) / trainer.WEIGHTS
        trainer.load_model_state(model, trainer.read_checkpoint(weights)["model"], weights)
        val = ADE20K(args.data, "validation", EvalTransform(scale=(4 * made["crop"], made["crop"])))
        scores = evaluate_miou(model, val, NUM_CLASSES, window=made["window"], stride=made["stride"], ctx=ctx)
        if ctx.main:
            atomic_write_text(Path(args.out) / MIOU, json.dumps(scores, indent=2))
            summary["val_mIoU"] = scores["mIoU"]

    return trainer_cli.run_recipe(args, made, training, finish)


def evaluate(args: argparse.Namespace, ctx: Dist) -> dict[str, Any]:
    """``mita seg eval``: a run's weights (``--checkpoint``: a run folder, ``.pt`` or ``.safetensors``) or a
    checkpoint of the Segmenter code (``--segmenter-checkpoint``, with ``--size`` and ``--decoder``) on the
    validation split, optionally with another attention (the swap); mIoU and per-class IoU."""
    from mita.models.segmenter import segmenter_state_dict

    if (args.checkpoint is None) == (args.segmenter_checkpoint is None):
        raise ValueError("give one of --checkpoint (a mita seg train run) and --segmenter-checkpoint")
    if args.checkpoint is not None:
        path = trainer.resolve_checkpoint(args.checkpoint)
        state = trainer.read_checkpoint(path)
        made = state["config"].get("recipe")
        if not isinstance(made, dict) or set(made) != set(RECIPE):
            raise ValueError(f"--checkpoint {path} is not a 'mita seg train' run")
        weights = state["model"]
    else:
        path = Path(args.segmenter_checkpoint)
        raw = load_checkpoint(path, "--segmenter-checkpoint")
        weights = segmenter_state_dict(raw["model"] if isinstance(raw.get("model"), dict) else raw)
        made = {**RECIPE, "size": args.size, "decoder": args.decoder, "decoder_depth": args.decoder_depth}
    made = {**made, "init": None}
    model = build_model(made)
    trainer.load_model_state(model, weights, path)
    if args.attention is not None or args.decoder_attention is not None:
        model.set_attention(args.attention, decoder=args.decoder_attention)
    model.to(ctx.device)
    window = args.window or made["window"]
    stride = args.stride or made["stride"]
    val = ADE20K(args.data, "validation", EvalTransform(scale=(4 * made["crop"], made["crop"])), limit=args.limit)
    scores = evaluate_miou(model, val, NUM_CLASSES, window=window, stride=stride, ctx=ctx)
    return {
        "checkpoint": str(path),
        "attention": args.attention or made["attention"],
        "decoder_attention": args.decoder_attention or made["decoder_attention"],
        "window": window,
        "stride": stride,
        **scores,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``mita seg train`` but ``--out``: the data, the recipe (left out: :data:`RECIPE`'s
    default, or on ``--resume`` the run's), loading processes and the trainer's flags."""
    helps = {
        "size": "ViT size: tiny, small, base or large",
        "decoder": "mask_transformer or linear",
        "attention": "the encoder's attention (any registered config; sdpa: softmax)",
        "decoder_attention": "the Mask Transformer's attention",
        "decoder_depth": "Mask Transformer blocks",
        "init": "timm ViT weights for the encoder (.safetensors / .pth), e.g. ImageNet-pretrained",
        "crop": "training crop (px), also the encoder's image size",
        "epochs": "epochs (on --resume it may grow)",
        "batch_size": "images a step per process",
        "lr": "AdamW learning rate (linear decay to 0)",
        "weight_decay": "AdamW weight decay (none on norms, biases, position and class embeddings)",
        "drop_path": "the encoder's stochastic depth",
        "window": "sliding-window size at evaluation (px)",
        "stride": "sliding-window stride at evaluation (px)",
        "eval_epochs": "epochs between evaluations",
        "val_images": "validation images of the periodic evaluation (miou.json uses all)",
        "amp": "bfloat16 autocast",
        "seed": "seed of the initialisation, the data order and every random draw",
    }
    trainer_cli.add_recipe_arguments(p, "ADEChallengeData2016, or the folder holding it", RECIPE, helps, workers=4)
