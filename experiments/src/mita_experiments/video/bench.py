"""A whole Hugging Face VideoMAE forward with MiTA against SDPA, side by side (``mita video bench``).

Random weights (no download). The two models share their weights; each round times one call of
each, alternating, so both see the same machine load; the result is the median over rounds.
"""

from __future__ import annotations

from typing import Any

import torch

from ..benchmarks.timing import alternating_rounds
from .flops import TOPK, VideoBackbone, landmarks


def videomae_models(backbone: VideoBackbone) -> dict[str, torch.nn.Module]:
    """``{"sdpa": ..., "mita": ...}``: the same random VideoMAE encoder with each attention, in eval mode."""
    from transformers import VideoMAEModel

    from mita.integrations import hf  # registers "mita"

    config = backbone.config()
    config.mita_num_landmarks, config.mita_topk = list(landmarks(backbone)), TOPK
    torch.manual_seed(0)
    sdpa = VideoMAEModel._from_config(config, attn_implementation="sdpa").eval()
    mita = VideoMAEModel._from_config(config, attn_implementation=hf.NAME).eval()
    mita.load_state_dict(sdpa.state_dict())
    return {"sdpa": sdpa, "mita": mita}


@torch.inference_mode()
def clip_throughput(backbone: VideoBackbone, batch: int = 1, rounds: int = 3, log=print) -> list[dict[str, Any]]:
    """Seconds per forward and clips/s of each attention at ``batch`` clips, median over ``rounds``
    alternating rounds after one warm-up call each; also the largest output difference to SDPA's."""
    models = videomae_models(backbone)
    clips = torch.randn(batch, backbone.frames, 3, backbone.image_size, backbone.image_size)
    calls = {name: (lambda model=model: model(clips).last_hidden_state) for name, model in models.items()}

    def progress(r: int, seconds: dict[str, float]) -> None:
        log(
            f"{backbone.name} B={batch} round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {t:.2f} s" for n, t in seconds.items())
        )

    measured = alternating_rounds(calls, rounds, on_round=progress)
    base = measured.median("sdpa")
    rows = []
    for name in models:
        median = measured.median(name)
        rows.append(
            {
                "model": backbone.name,
                "N": backbone.tokens,
                "batch": batch,
                "attention": "sdpa" if name == "sdpa" else f"mita m={landmarks(backbone)} k={TOPK}",
                "forward s (median)": median,
                "clips/s": batch / median,
                "speed-up": base / median,
                "rounds": rounds,
                "finite": bool(torch.isfinite(measured.outputs[name]).all()),
            }
        )
    return rows
