"""``mita vision train``: the ImageNet-1K recipe for MiTA-DeiT, a small DeiT-style trainer.

It trains any timm model name (the registered ``mita_deit_*`` ones included) on an
ImageFolder tree (``DATA/train/<class>/*.JPEG``, ``DATA/val/<class>/*.JPEG``) with the DeiT
recipe's pieces from timm (RandAugment, random erasing, Mixup/CutMix, label smoothing, AdamW,
cosine schedule with warm-up, stochastic depth). Launched by ``torchrun`` it runs data-parallel
(one process per GPU, NCCL; gloo on CPU). Every epoch it saves ``OUT/checkpoint.pth`` (tensors
and plain types, loaded with ``weights_only=True``) and ``OUT/model.safetensors`` (the
weights, for exchange); ``--resume`` continues from the checkpoint, and an existing run is
never overwritten without ``--resume`` or ``--force``. Its parser is in :mod:`mita_experiments.vision.cli`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mita.utils.options import parse_assignments, split_items

from ..utils.checkpoint import load_checkpoint, save_checkpoint, save_weights
from ..utils.distributed import init_distributed
from ..utils.files import atomic_write_text, prepare_output_dir

CHECKPOINT = "checkpoint.pth"


def _check_args(args: argparse.Namespace) -> tuple[Path, Path]:
    """Every argument, and the output folder, checked before any work."""
    data, output = Path(args.data), Path(args.out)
    for split in ("train", "val"):
        if not (data / split).is_dir():
            raise FileNotFoundError(f"--data {data} needs an ImageFolder tree with {split}/<class>/<images>")
    for name in ("epochs", "batch_size", "img_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("workers", "max_steps", "warmup_epochs"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if (args.mixup > 0 or args.cutmix > 0) and args.batch_size % 2:
        raise ValueError(
            f"Mixup/CutMix needs an even --batch-size, got {args.batch_size} (or pass --mixup 0 --cutmix 0)"
        )
    if args.resume and not (output / CHECKPOINT).is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {output / CHECKPOINT}")
    if (output / CHECKPOINT).exists() and not (args.resume or args.force):
        raise FileExistsError(f"{output / CHECKPOINT} exists; pass --resume to continue it or --force to start over")
    hint = "pass --force to start over in it, or pick another --out"
    prepare_output_dir(output, force=args.force, reuse=args.resume, create=False, hint=hint)
    return data, output


def model_args(text: str | None) -> dict[str, Any]:
    """``--model-args 'num_landmarks=25,topk=25'`` as a dict (a key given twice is an error)."""
    return parse_assignments(split_items(text or ""), "--model-args")


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train and evaluate; returns the last epoch's summary (also written to OUTPUT/summary.json)."""
    import timm
    from timm.data import Mixup, create_transform, resolve_data_config
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import CosineLRScheduler
    from torchvision.datasets import ImageFolder

    from mita.models.deit import register_models

    data, output = _check_args(args)
    register_models()
    ctx = init_distributed()
    distributed, rank, world, device = ctx.distributed, ctx.rank, ctx.world, ctx.device
    torch.manual_seed(args.seed + rank)
    classes = ImageFolder(data / "val").classes
    model = timm.create_model(
        args.model,
        num_classes=len(classes),
        drop_path_rate=args.drop_path,
        img_size=args.img_size,
        **model_args(args.model_args),
    ).to(device)
    cfg = resolve_data_config({"input_size": (3, args.img_size, args.img_size)}, model=model)
    train_set = ImageFolder(data / "train", train_transform(cfg, args.aa, args.reprob))
    val_set = ImageFolder(data / "val", create_transform(**cfg))
    if train_set.classes != classes:
        raise ValueError(f"train and val classes differ: {train_set.classes} vs {classes}")
    sampler = torch.utils.data.DistributedSampler(train_set, seed=args.seed) if distributed else None
    loader = torch.utils.data.DataLoader(
        train_set,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=len(train_set) >= args.batch_size * world,
        pin_memory=device.type == "cuda",
    )
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers)
    lr = args.lr * args.batch_size * world / 512  # DeiT's linear scaling rule
    optimizer = create_optimizer_v2(model, "adamw", lr=lr, weight_decay=args.weight_decay)
    scheduler = CosineLRScheduler(
        optimizer, t_initial=args.epochs, warmup_t=args.warmup_epochs, warmup_lr_init=1e-6, lr_min=1e-5
    )
    mixup = None
    if args.mixup > 0 or args.cutmix > 0:
        mixup = Mixup(
            mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing, num_classes=len(classes)
        )
    criterion = SoftTargetCrossEntropy() if mixup else torch.nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    start, steps, best = 0, 0, 0.0
    ckpt = output / CHECKPOINT
    if args.resume:
        state = load_checkpoint(ckpt)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, steps, best = state["epoch"], state["steps"], state["best"]
    ddp = (
        torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if distributed
        else model
    )
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    for epoch in range(start, args.epochs):
        scheduler.step(epoch)
        if sampler is not None:
            sampler.set_epoch(epoch)
        ddp.train()
        t0, total, seen = time.perf_counter(), 0.0, 0
        for images, targets in loader:
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            if mixup is not None:
                images, targets = mixup(images, targets)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = criterion(ddp(images), targets)
            if not math.isfinite(float(loss.detach())):
                raise ValueError(f"the loss is {float(loss)} at step {steps}; lower --lr or check the data")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if args.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            total, seen, steps = total + float(loss.detach()) * len(images), seen + len(images), steps + 1
            if args.max_steps and steps >= args.max_steps:
                break
        accuracy = evaluate(model, val_loader, device, args.amp)
        best = max(best, accuracy)
        summary = {
            "epoch": epoch + 1,
            "steps": steps,
            "train_loss": total / max(seen, 1),
            "val_top1": accuracy,
            "best_val_top1": best,
            "epoch_seconds": time.perf_counter() - t0,
            "lr": optimizer.param_groups[0]["lr"],
        }
        if rank == 0:
            recipe = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "steps": steps,
                "best": best,
                "args": recipe,
            }
            save_checkpoint(state, ckpt)
            save_weights(model.state_dict(), output / "model.safetensors", {"timm_model": args.model})
            with open(output / "log.jsonl", "a") as f:
                f.write(json.dumps(summary) + "\n")
            atomic_write_text(output / "summary.json", json.dumps(summary, indent=2) + "\n")
            print(json.dumps(summary))
        if args.max_steps and steps >= args.max_steps:
            break
    if distributed:
        dist.destroy_process_group()
    return summary


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, amp: bool = False) -> float:
    """Top-1 accuracy (%) on the validation loader (every process evaluates the whole set)."""
    model.eval()
    correct = total = 0
    for images, targets in loader:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(images.to(device))
        correct += int((logits.argmax(-1).cpu() == targets).sum())
        total += len(targets)
    return 100.0 * correct / max(total, 1)
