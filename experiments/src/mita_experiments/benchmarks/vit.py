"""``mita bench vit``: a whole timm ViT converted to MiTA against itself unconverted, side by side.

Random weights (no download). For each model, image size and mode, the unconverted model
(timm's attention, ``timm``) and a copy converted by ``mita.convert(model, "mita",
num_landmarks=m, topk=k)`` start from the same weights and see the same input; each round
times one call of each, alternating, after a warm-up call each
(:func:`mita_experiments.benchmarks.models.side_by_side`), and the result is the median over rounds.

* ``infer``: one forward of a batch in eval mode under ``torch.inference_mode()``;
* ``train``: one training step in train mode (dropout as the model's defaults, off for timm's
  DeiT): forward, cross-entropy on fixed labels, backward, an AdamW step; each variant has its
  own optimizer.

MiTA approximates attention, so the outputs differ; what is checked is that they are finite
(the logits of the warm-up forward, the loss of the warm-up step).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mita.utils.options import parse_assignments, split_items

from .models import OnRound, add_common_arguments, run_points, side_by_side

MODELS = ("deit_small_patch16_224", "deit_tiny_patch16_224")
MODES = ("infer", "train")
BASELINE = "timm"  # the unconverted model's name in the rows
LR, WEIGHT_DECAY = 5e-4, 0.05  # DeiT's AdamW; the values do not change the time of a step
HELP = "a whole timm ViT converted to MiTA against itself unconverted: images/s, steps/s"
DTYPES = ("float32", "bfloat16")
METHOD = (
    "Random weights, float32 (with --dtype bfloat16: under torch.autocast, as timm's --amp-dtype "
    "bfloat16), {threads} torch threads. Each round times one call of each model, "
    "alternating, after one warm-up call each; the seconds are the median over the rounds and the "
    "speed-up is over the unconverted model measured in the same process. infer: a forward in eval "
    "mode under torch.inference_mode(); train: forward, cross-entropy, backward and an AdamW step. "
    "finite: that model's output (the logits, or the loss) has no NaN or infinity; MiTA "
    "approximates attention, so the two outputs are not compared."
)


@dataclasses.dataclass(frozen=True)
class Size:
    """One measured setting: ``image`` px square inputs, ``batch`` images a call, MiTA's m and k."""

    image: int
    batch: int
    landmarks: int  # m, a perfect square (2-D landmarks on the patch grid)
    topk: int  # k

    def __str__(self) -> str:
        return f"{self.image}:{self.batch}:{self.landmarks}:{self.topk}"


#: issue 11's settings: 224 px at batch 16 with m = k = 25, 512 px at batch 4 with m = k = 49
SIZES = (Size(224, 16, 25, 25), Size(512, 4, 49, 49))


def parse_size(text: str) -> Size:
    """``"PX:BATCH:M[:K]"`` (k = m when left out) as a :class:`Size`; a ValueError names ``--sizes``."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (3, 4):
        raise ValueError(f"--sizes takes PX:BATCH:M[:K] whole numbers (e.g. 224:16:25:25), got {text!r}")
    size = Size(*values[:3], values[3] if len(values) == 4 else values[2])
    if size.image < 1 or size.batch < 1 or size.topk < 1:
        raise ValueError(f"--sizes {text}: image size, batch and k must be >= 1")
    if size.landmarks < 1 or math.isqrt(size.landmarks) ** 2 != size.landmarks:
        raise ValueError(
            f"--sizes {text}: m must be a perfect square (landmarks on the patch grid), got {size.landmarks}"
        )
    return size


def _create(name: str, image: int, model_kwargs: dict[str, Any]) -> torch.nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, img_size=image, **model_kwargs)


def check_settings(
    models: Sequence[str], sizes: Sequence[Size], modes: Sequence[str], rounds: int, model_kwargs: dict[str, Any]
) -> None:
    """Every setting checked before any work, each error naming its flag: known timm models that
    :func:`mita.convert` takes, image sizes that are multiples of each model's patch size, modes, rounds."""
    import timm

    from mita.models.convert import convert

    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if not models or not sizes or not modes:
        raise ValueError("--models, --sizes and --modes each need at least one value")
    bad = sorted(set(modes) - set(MODES))
    if bad:
        raise ValueError(f"--modes takes {list(MODES)}, got {bad}")
    for name in models:
        if not timm.is_model(name):
            raise ValueError(f"--models: {name!r} is not a timm model")
        with torch.device("meta"):  # no memory, no initialization work
            model = _create(name, sizes[0].image, model_kwargs)
            patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
            if patch is None:
                raise ValueError(f"--models: {name!r} has no patch embedding (a timm ViT is needed)")
            for size in sizes:
                if size.image % patch[0] or size.image % patch[1]:
                    raise ValueError(
                        f"--sizes {size}: {size.image} px is not a multiple of {name}'s patch size {tuple(patch)}"
                    )
            convert(model, "mita", num_landmarks=sizes[0].landmarks, topk=sizes[0].topk)


def variants(name: str, size: Size, model_kwargs: dict[str, Any], seed: int = 0) -> dict[str, torch.nn.Module]:
    """``{"timm": model, "mita": converted copy}`` of the same random weights at ``size``'s image size."""
    from mita.models.convert import convert

    torch.manual_seed(seed)
    base = _create(name, size.image, model_kwargs)
    converted = convert(copy.deepcopy(base), "mita", num_landmarks=size.landmarks, topk=size.topk)
    return {BASELINE: base, "mita": converted}


def _precision(dtype: str) -> contextlib.AbstractContextManager:
    """float32: nothing; bfloat16: CPU autocast, as mixed-precision inference and training run."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()


def inference_call(model: torch.nn.Module, images: torch.Tensor, dtype: str = "float32") -> Callable[[], torch.Tensor]:
    """One forward of ``images`` in eval mode under inference mode (and autocast for bfloat16); returns the logits."""
    model.eval()

    def forward() -> torch.Tensor:
        with torch.inference_mode(), _precision(dtype):
            return model(images)

    return forward


def training_call(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, dtype: str = "float32"
) -> Callable[[], torch.Tensor]:
    """One training step of ``model`` (train mode, its own AdamW): forward and cross-entropy on
    ``labels`` (under autocast for bfloat16), backward, optimizer step; returns the loss."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with _precision(dtype):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def measure(
    name: str,
    size: Size,
    mode: str,
    rounds: int,
    *,
    model_kwargs: dict[str, Any] | None = None,
    on_round: OnRound | None = None,
    dtype: str = "float32",
) -> list[dict[str, Any]]:
    """The rows of one model, size and mode: the unconverted model first, then MiTA.

    Args:
        name: a timm ViT name (``deit_small_patch16_224``).
        size: image size, batch, m and k.
        mode: ``"infer"`` or ``"train"`` (see the module doc).
        rounds: timed rounds, one call of each variant each.
        model_kwargs: extra ``timm.create_model`` options (``depth=2`` for quick tests).
        on_round: progress callback of :func:`~mita_experiments.benchmarks.timing.alternating_rounds`.
        dtype: ``"float32"`` (default) or ``"bfloat16"`` (both models under CPU autocast).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    models = variants(name, size, model_kwargs or {})
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(size.batch, 3, size.image, size.image, generator=gen)
    labels = torch.randint(0, models[BASELINE].num_classes, (size.batch,), generator=gen)
    make = (
        functools.partial(inference_call, dtype=dtype)
        if mode == "infer"
        else functools.partial(training_call, labels=labels, dtype=dtype)
    )
    timed = side_by_side({v: make(m, images) for v, m in models.items()}, rounds, BASELINE, on_round)
    base = models[BASELINE]  # tokens: the patches, the prefix (CLS, registers) and any suffix (ViT-5's registers)
    ends = int(getattr(base, "num_prefix_tokens", 0)) + int(getattr(base, "num_suffix_tokens", 0))
    tokens = math.prod(base.patch_embed.grid_size) + ends
    return [
        {
            "model": name,
            "px": size.image,
            "N": tokens,
            "batch": size.batch,
            "mode": mode,
            "dtype": dtype,
            "attention": variant if variant == BASELINE else f"mita m={size.landmarks} k={size.topk}",
            "seconds (median)": t["median"],
            "images/s": size.batch / t["median"],
            "steps/s": 1 / t["median"] if mode == "train" else "",
            "speed-up": t["speed-up"],
            "page faults/call": t["faults"],
            "rounds": rounds,
            "finite": t["finite"],
        }
        for variant, t in timed.items()
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``mita bench vit``."""
    p.add_argument("--models", nargs="+", default=list(MODELS), help="timm ViT names")
    p.add_argument(
        "--sizes",
        nargs="+",
        default=[str(s) for s in SIZES],
        metavar="PX:BATCH:M[:K]",
        help="image size, batch, MiTA landmarks m (a square) and keys k (default k = m)",
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="infer: a forward; train: a step")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (one call of each model per round)")
    p.add_argument("--model-args", help="extra create_model options for every model, e.g. 'depth=2'")
    p.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="bfloat16: both models under CPU autocast (default float32)"
    )
    add_common_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Every model x size x mode side by side; results.csv and results.md in ``--out``."""
    sizes = [parse_size(text) for text in args.sizes]
    kwargs = parse_assignments(split_items(args.model_args or ""), "--model-args")
    check_settings(args.models, sizes, args.modes, args.rounds, kwargs)
    points = [
        (
            f"{name} {size.image} px {mode}",
            lambda on_round, name=name, size=size, mode=mode: measure(
                name, size, mode, args.rounds, model_kwargs=kwargs, on_round=on_round, dtype=args.dtype
            ),
        )
        for name in args.models
        for size in sizes
        for mode in args.modes
    ]
    title = "Whole-model speed: timm ViTs converted to MiTA vs unconverted"
    return run_points(args, "vit", points, title, lambda threads: METHOD.format(threads=threads))
