"""The offline segmentation experiment on generated scenes (``mita seg scenes``), one report.

Two Segmenters are trained on one budget, one with softmax attention (SDPA) in the encoder and
one with MiTA; then

* **runs**: the test mIoU and pixel accuracy of each;
* **swap** (the MiTA paper's): the SDPA-trained model evaluated with MiTA and every other
  registered method in its encoder (and MiTA in encoder and decoder), without retraining: mIoU and
  the share of the SDPA model's mIoU kept;
* **robustness**: the MiTA-trained model evaluated over a grid of m and k.

Everything goes to ``out``: ``report.md``, ``runs.csv``, ``swap.csv``, ``robustness.csv`` (each row
with the date and the machine), ``swap.png``, ``robustness.png``; the models' run folders
(``sdpa/``, ``mita/``) resume an interrupted experiment.
"""

from __future__ import annotations

import copy
import csv
import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from mita import attention as registry

from ..utils.files import atomic_write, atomic_write_text
from ..utils.machine import describe
from ..vision.digits import Tensors
from ..vision.experiments import (
    config_string,
    mita_layers,
    plot_robustness,
    plot_swap,
    robustness_grid,
    sized_options,
    swap_configs,
)
from ..vision.flops import markdown_table
from .scenes import NUM_CLASSES, SHAPE_PX, SHAPES, SHAPES_PER_SCENE, SIZE, load_scenes
from .task import PATCH, ScenesSetup, evaluate_miou, train_scenes

TOKENS = (SIZE // PATCH) ** 2  # 144 patches, plus the CLS token
#: each method's options at N = 145 on the 12 x 12 patch grid
SCENES_OPTIONS = sized_options(landmarks=16, topk=16, block_size=16, window=8)
TRAIN_MITA = config_string("mita", SCENES_OPTIONS["mita"])
SWAP_EXTRA = ("mita:num_landmarks=4,topk=8", "mita:num_landmarks=36,topk=64", "mita:num_landmarks=64,topk=145")
ROBUSTNESS_M = (1, 4, 9, 16, 36, 64)
ROBUSTNESS_K = (4, 8, 16, 32, 64, 145)
RUNS = ("sdpa", "mita")
Log = Callable[[str], None]


def write_csv(path: Path, rows: Sequence[dict[str, Any]], stamp: dict[str, str]) -> None:
    """``rows`` as a CSV at ``path`` (atomically), each row with the columns of ``stamp`` (date, machine)."""
    with atomic_write(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *stamp])
        writer.writeheader()
        writer.writerows({**row, **stamp} for row in rows)


def _percent(scores: dict[str, Any]) -> tuple[float, float]:
    return 100 * scores["mIoU"], 100 * scores["pixel_accuracy"]


def run_scenes(
    out: Path,
    setup: ScenesSetup,
    command: str,
    *,
    configs: Sequence[str] | None = None,
    ms: Sequence[int] = ROBUSTNESS_M,
    ks: Sequence[int] = ROBUSTNESS_K,
    force: bool = False,
    data: tuple[torch.Tensor, ...] | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """Train SDPA and MiTA (``TRAIN_MITA``) Segmenters with ``setup``, then the swap over ``configs``
    (default :func:`swap_configs`) and the robustness grid ``ms`` x ``ks``; writes the report (module doc)."""
    bad = [m for m in ms if math.isqrt(m) ** 2 != m]
    if bad:
        raise ValueError(f"--m values must be perfect squares (2-D pooling on the 12x12 patch grid), got {bad}")
    for config in configs or ():
        registry.resolve(config)
    data = data if data is not None else load_scenes(setup.seed)
    test = Tensors(data[2], data[3])
    stamp = {"date": datetime.date.today().isoformat(), "machine": describe()}
    models, runs = {}, []
    for name, attention in (("sdpa", "sdpa"), ("mita", TRAIN_MITA)):
        models[name], summary = train_scenes(replace(setup, attention=attention), data, out / name, force=force)
        runs.append(
            {
                "encoder attention": attention,
                "test mIoU (%)": 100 * summary["mIoU"],
                "pixel accuracy (%)": 100 * summary["pixel_accuracy"],
                "train s": summary["train_seconds"],
            }
        )
        log(f"{attention}: mIoU {100 * summary['mIoU']:.2f}%")
    base = runs[0]["test mIoU (%)"]
    swaps = []
    for config in [*(configs or swap_configs(SCENES_OPTIONS, SWAP_EXTRA)), f"{TRAIN_MITA} (decoder too)"]:
        model = copy.deepcopy(models["sdpa"])
        encoder = config.removesuffix(" (decoder too)")
        model.set_attention(encoder, decoder=encoder if encoder != config else None)
        t0 = time.perf_counter()
        miou, accuracy = _percent(evaluate_miou(model, test, NUM_CLASSES, batch_size=100))
        swaps.append(
            {
                "attention at test time": config,
                "test mIoU (%)": miou,
                "mIoU kept (%)": 100 * miou / base if base else float("nan"),
                "pixel accuracy (%)": accuracy,
                "eval s": time.perf_counter() - t0,
            }
        )
        log(f"swap {config}: mIoU {miou:.2f}%")
    model = models["mita"]
    layers = [layer for layer in mita_layers(model) if layer.num_prefix_tokens == 1]  # the encoder's
    grid = robustness_grid(
        layers, ms, ks, lambda: 100 * evaluate_miou(model, test, NUM_CLASSES, batch_size=100)["mIoU"], log
    )
    plot_swap(out, swaps, "mIoU kept (%)", "test mIoU kept after the swap (% of the SDPA model's)", "95%")
    robustness = plot_robustness(out, grid, ms, ks, f"trained: {TRAIN_MITA}", "test mIoU (%)")
    write_csv(out / "runs.csv", runs, stamp)
    write_csv(out / "swap.csv", swaps, stamp)
    write_csv(out / "robustness.csv", robustness, stamp)
    n_train, n_test = len(data[1]), len(data[3])
    setup_text = ", ".join(f"{k}={v}" for k, v in asdict(setup).items() if k != "attention")
    sections = [
        "# Segmenter on generated shape scenes: SDPA against MiTA, the attention swap, m and k",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {stamp['machine']}; date {stamp['date']}",
        "",
        f"Data: {n_train} training / {n_test} test scenes of {SIZE}x{SIZE} px, {SHAPES_PER_SCENE[0]}-"
        f"{SHAPES_PER_SCENE[1]} shapes ({', '.join(SHAPES)}) of {SHAPE_PX[0]}-{SHAPE_PX[1]} px on textured "
        f"backgrounds, {NUM_CLASSES} classes; patches of {PATCH} px ({SIZE // PATCH}x{SIZE // PATCH} grid + CLS, "
        f"N = {TOKENS + 1}). Setup: {setup_text}.",
        "",
        "## Trained on one budget",
        "",
        markdown_table(runs),
        "## Swap: the SDPA-trained model evaluated with other attentions in its encoder",
        "",
        markdown_table(swaps),
        "![mIoU kept](swap.png)",
        "",
        f"## Robustness: the model trained with {TRAIN_MITA}, test mIoU (%) over m (rows) and k (columns)",
        "",
        markdown_table(robustness),
        "![mIoU over m and k](robustness.png)",
    ]
    atomic_write_text(out / "report.md", "\n".join(sections) + "\n")
    return {"runs": runs, "swap": swaps, "robustness": grid}
