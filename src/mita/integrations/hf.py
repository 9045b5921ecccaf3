"""Hugging Face transformers integration: ``attn_implementation="mita"`` for encoder models.

``import mita.integrations.hf`` registers ``"mita"`` with transformers' ``AttentionInterface``
(the attention itself) and ``AttentionMaskInterface`` (so the model hands over its padding
mask as a (B, N) bool mask instead of an N x N one). Then::

    model = AutoModel.from_config(ViTConfig(mita_num_landmarks=25, mita_topk=25), attn_implementation="mita")

MiTA options are read from the model config; defaults for video configs (a frame count and a
patch grid: VideoMAE, ViViT, V-JEPA 2, ...), for image configs (``image_size`` and ``patch_size``)
and for the others (BERT, ...):

- ``mita_num_landmarks``: (2, 7, 7), clamped to the token grid / 25 (a 5x5 grid) / 64
- ``mita_topk``: 98 / 25 / 64
- ``mita_num_routed``: 1
- ``mita_grid``: "auto" / "auto" / None (1-D pooling); or [gh, gw] or [gt, gh, gw]
- ``mita_num_prefix_tokens``: 1 for ViViT's CLS token, else 0 / 1 (CLS) / 0
- ``mita_num_suffix_tokens``: 0 (tokens after the patches, as ViT-5's registers, that are not pooled)

"auto" is, for images, the patch grid of the image being run (models built with
``attn_implementation="mita"`` hook their patch embeddings to record it, so an image resized
under ``interpolate_pos_encoding=True`` is pooled on its own rows and columns), else the
config's (``image_size / patch_size``) grid when the tokens after the prefix are that many
(other token counts are an error); for video, the config's (num_frames / tubelet, rows,
columns) grid of patch tokens after the prefix; a video
model's token sets of other lengths (V-JEPA 2's predictor, pooler query and shorter clips,
X-CLIP's per-frame and frame tokens, VideoMAE's visible tokens in pre-training) are no such
grid and are pooled in 1-D, with m the product of the landmark grid.

MiTA has no causal form yet: decoder models and causal calls raise a ``ValueError``, as do
attention calls with soft-capping, a sliding window, sinks or packed sequences (VideoPrism's
softcap). Models whose attention does not go through transformers' attention interface
(TimeSformer, TVP, timm models wrapped by ``TimmWrapperModel`` as in PE Video, ...) would ignore
``"mita"``; creating one with it raises a ``ValueError``.
Padding is said per side: in self-attention the padding mask marks the queries too; a
cross-attention module (``is_cross_attention`` or a ``...CrossAttention`` class) is never taken
for self-attention.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, sdpa_mask

from ..layers.base import PatchGrid
from ..ops.mita import mita_attention

NAME = "mita"


#: video encoders with a CLS token before their patch tokens (by ``config.model_type``)
VIDEO_PREFIX_TOKENS = {"vivit": 1, "xclip_vision_model": 1}
#: the default landmark grid of video models (the 2 x 7 x 7 = 98 of 16 frames at 224 px), clamped to the tokens'
VIDEO_LANDMARKS = (2, 7, 7)
VIDEO_TOPK = 98
#: attention-call arguments MiTA has no form of (refused when set), and what they are
UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "sliding_window": "sliding-window form",
    "s_aux": "attention sinks",
    "cu_seq_lens_q": "packed (varlen) form",
}


def is_vision_config(config: Any) -> bool:
    """A ViT-like config: images cut into patches (the patch grid gives 2-D landmark pooling)."""
    return hasattr(config, "image_size") and hasattr(config, "patch_size")


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


def video_grid(config: Any) -> tuple[int, int, int] | None:
    """A video config's token grid (tubelets in time, patch rows, patch columns); None for other configs.

    A video config has a frame count (``num_frames`` or ``frames_per_clip``), an image size
    (``image_size`` or ``crop_size``) and a patch (``patch_size`` and an int ``tubelet_size``, or a
    ``tubelet_size`` of three).
    """
    frames = getattr(config, "num_frames", None) or getattr(config, "frames_per_clip", None)
    image = getattr(config, "image_size", None) or getattr(config, "crop_size", None)
    tubelet = getattr(config, "tubelet_size", None) or 1
    patch = getattr(config, "patch_size", None)
    if isinstance(tubelet, (list, tuple)):
        tubelet, patch = tubelet[0], patch or tubelet[1:]
    if not frames or not image or not patch:
        return None
    (ih, iw), (ph, pw) = _pair(image), _pair(patch)
    return int(frames) // int(tubelet), ih // ph, iw // pw


def _grid_option(grid: Any) -> tuple[int, ...] | str | None:
    if grid is None or grid == "auto":
        return grid
    if not (isinstance(grid, (list, tuple)) and len(grid) in (2, 3)):
        raise ValueError(f"config.mita_grid must be 'auto', None or a list [gh, gw] or [gt, gh, gw], got {grid!r}")
    return tuple(int(g) for g in grid)


def mita_options(config: Any, num_tokens: int, patch_grid: tuple[int, int] | None = None) -> dict[str, Any]:
    """The MiTA arguments for a sequence of ``num_tokens`` tokens of a model with this config.

    ``patch_grid`` is the (rows, columns) of patches of the image being run, where known; it
    is the 2-D grid whenever the tokens after the prefix are that grid.
    """
    layout = video_grid(config)
    if layout is not None:
        return _video_options(config, num_tokens, layout)
    vision = is_vision_config(config)
    default_m = 25 if vision else 64
    options = {
        "num_landmarks": getattr(config, "mita_num_landmarks", default_m),
        "topk": getattr(config, "mita_topk", default_m),
        "num_routed": getattr(config, "mita_num_routed", 1),
        "num_prefix_tokens": getattr(config, "mita_num_prefix_tokens", 1 if vision else 0),
        "num_suffix_tokens": getattr(config, "mita_num_suffix_tokens", 0),
    }
    grid = _grid_option(getattr(config, "mita_grid", "auto" if vision else None))
    pooled = num_tokens - options["num_prefix_tokens"] - options["num_suffix_tokens"]
    pools_2d = grid == "auto" or (grid is not None and len(grid) == 2)
    if pools_2d and patch_grid is not None and math.prod(patch_grid) == pooled:
        grid = tuple(patch_grid)
    elif grid == "auto":
        side = math.isqrt(max(pooled, 0))
        grid = _config_grid(config) if vision else (side, side)
        if math.prod(grid) != pooled or pooled < 1:
            layout = f"the config's image size, {grid}" if vision else "a square"
            seen = "was not recorded" if patch_grid is None else f"is {tuple(patch_grid)}"
            raise ValueError(
                f"config.mita_grid='auto' needs the tokens after the prefix to be a patch grid: the image's own "
                f"(which {seen}) or that of {layout}; got N - num_prefix_tokens - num_suffix_tokens = {num_tokens} - "
                f"{options['num_prefix_tokens']} - {options['num_suffix_tokens']} = {pooled}. Set config.mita_grid = "
                "[gh, gw] or None (1-D pooling), or config.mita_num_prefix_tokens / mita_num_suffix_tokens"
            )
    options["grid"] = grid
    return options


def _config_grid(config: Any) -> tuple[int, int]:
    """The patch grid of the config's image size."""
    (ih, iw), (ph, pw) = _pair(config.image_size), _pair(config.patch_size)
    return ih // ph, iw // pw


def _video_options(config: Any, num_tokens: int, layout: tuple[int, int, int]) -> dict[str, Any]:
    """:func:`mita_options` of a video config: its (time, rows, columns) grid where the tokens are that layout."""
    prefix = getattr(config, "mita_num_prefix_tokens", VIDEO_PREFIX_TOKENS.get(getattr(config, "model_type", ""), 0))
    suffix = getattr(config, "mita_num_suffix_tokens", 0)
    grid = _grid_option(getattr(config, "mita_grid", "auto"))
    if grid == "auto":
        grid = layout if num_tokens - prefix - suffix == math.prod(layout) else None
    m = getattr(config, "mita_num_landmarks", None)
    if m is None:  # the default grid of landmarks, clamped to the (given or config's) token grid
        m = tuple(map(min, VIDEO_LANDMARKS[-len(grid or layout) :], grid or layout))
    if grid is None and isinstance(m, (list, tuple)):
        m = math.prod(m)  # 1-D pooling of a token set that is no grid: as many landmarks as the grid has
    return {
        "num_landmarks": tuple(m) if isinstance(m, list) else m,
        "topk": getattr(config, "mita_topk", VIDEO_TOPK),
        "num_routed": getattr(config, "mita_num_routed", 1),
        "num_prefix_tokens": prefix,
        "num_suffix_tokens": suffix,
        "grid": grid,
    }


def key_padding_mask(attention_mask: torch.Tensor | None, batch: int, kv_length: int) -> torch.Tensor | None:
    """HF's mask (2-D 1/0, 4-D bool, or 4-D additive float) as a (B, Nk) bool mask, True = real key.

    A 4-D mask is accepted only if it is a pure padding mask (the same key pattern in every row).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor or None for MiTA, got {type(attention_mask).__name__}")
    mask = attention_mask
    if mask.dim() == 4:
        full = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 = attend
        keys = full.any(dim=-2)[:, 0]
        if not bool((full == keys[:, None, None, :]).all()):
            raise ValueError(
                "MiTA accepts only padding masks (every query sees the same real keys); this 4-D attention_mask "
                "is causal or otherwise structured"
            )
        mask = keys
    elif mask.dim() == 2:
        mask = mask.bool()
    else:
        raise ValueError(f"attention_mask must be 2-D (B, N) or 4-D (B, 1, Nq, Nk), got shape {tuple(mask.shape)}")
    if tuple(mask.shape) != (batch, kv_length):
        raise ValueError(f"attention_mask covers {tuple(mask.shape)} but the keys are (B={batch}, Nk={kv_length})")
    return None if bool(mask.all()) else mask


def mita_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=bidirectional_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask-creation hook: a plain padding mask stays (B, N); anything else is built as SDPA's."""
    if mask_function is bidirectional_mask_function and q_offset == 0 and kv_offset == 0:
        return None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def mita_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, N, D) in, ((B, N, H, D), no weights) out."""
    if is_causal or (is_causal is None and getattr(module, "is_causal", False)):
        raise ValueError(
            f"attn_implementation='mita' has no causal form yet ({type(module).__name__} is causal); "
            "use it with encoder models (ViT, BERT, ...) or pick 'sdpa' for decoders"
        )
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='mita' does not return attention weights; use output_attentions=False")
    for name, what in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='mita' has no {what}, which {type(module).__name__} asks for "
                f"({name}={kwargs[name]!r}); use 'sdpa' or 'eager' for this model"
            )
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no .config to read the MiTA options from")
    B, _, Nq, _ = query.shape
    mask = key_padding_mask(attention_mask, B, key.shape[2])
    # Padding per side: self-attention's queries are its keys; a cross-attention module's queries
    # are other tokens, whose padding HF does not hand over (never taken for self-attention).
    cross = bool(getattr(module, "is_cross_attention", False)) or "CrossAttention" in type(module).__name__
    query_mask = torch.ones(B, Nq, dtype=torch.bool, device=query.device) if cross else None
    if not cross and mask is not None and Nq == key.shape[2]:
        query_mask = mask
    patch_grid = getattr(module, "mita_patch_grid", None)
    out = mita_attention(
        query,
        key,
        value,
        **mita_options(config, Nq, None if patch_grid is None else patch_grid.current),
        key_padding_mask=mask,
        query_padding_mask=query_mask,
        scale=scaling,
        dropout_p=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


class _RecordImageGrid:
    """A forward pre-hook on a vision model's embeddings: the patch grid (rows, columns) of each image."""

    def __init__(self, patch_grid: PatchGrid) -> None:
        self.patch_grid = patch_grid

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        image = args[0] if args else None
        if isinstance(image, torch.Tensor) and image.dim() == 4:  # pixel values (B, C, H, W)
            ph, pw = _pair(module.patch_size)
            self.patch_grid.current = (image.shape[-2] // ph, image.shape[-1] // pw)
        else:
            self.patch_grid.current = None


def _track_patch_grid(model: torch.nn.Module) -> None:
    """Let the MiTA attention of ``model`` pool each image on its own patch grid (idempotent).

    Under ``interpolate_pos_encoding=True`` the image size, and so the grid, changes per call:
    the config's grid would pool a 256x144 image (16x9 patches) as 12x12. A pre-hook on each
    image embedding (a ``...Embeddings`` module with a ``patch_size``) records the grid of the
    pixel values it gets, and every module of an image config reads it as ``mita_patch_grid``.
    """
    embeddings = [m for m in model.modules() if type(m).__name__.endswith("Embeddings") and hasattr(m, "patch_size")]
    if not embeddings:
        return
    hooks = [h for m in embeddings for h in m._forward_pre_hooks.values() if isinstance(h, _RecordImageGrid)]
    patch_grid = hooks[0].patch_grid if hooks else PatchGrid()
    for m in embeddings:
        if not any(isinstance(h, _RecordImageGrid) for h in m._forward_pre_hooks.values()):
            m.register_forward_pre_hook(_RecordImageGrid(patch_grid))
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and is_vision_config(config) and video_grid(config) is None:
            m.mita_patch_grid = patch_grid


def _track_after_post_init(post_init):
    """Wrap ``PreTrainedModel.post_init``: a model built with ``attn_implementation="mita"`` tracks its patch grid."""

    def post_init_and_track(self) -> None:
        post_init(self)
        if getattr(self.config, "_attn_implementation", None) == NAME:
            _track_patch_grid(self)

    post_init_and_track.mita_tracks = True
    return post_init_and_track


def _refuse_models_without_the_interface(get_correct_attn_implementation):
    """Wrap ``PreTrainedModel.get_correct_attn_implementation``: ``"mita"`` on a model whose attention
    does not go through ``ALL_ATTENTION_FUNCTIONS`` (transformers' own heuristic) raises instead of being ignored."""

    def checked(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        if requested_attention == NAME and getattr(self.config, "model_type", None) == "timm_wrapper":
            raise ValueError(
                f"{type(self).__name__} runs a timm model, whose attention is timm's and would ignore "
                "attn_implementation='mita'; give it 'sdpa' (a dict attn_implementation for composite models such as "
                "PE Video) and swap the timm model's attention with mita.convert(model.timm_model, 'mita')"
            )
        if requested_attention == NAME and not self._can_set_attn_implementation():
            raise ValueError(
                f"{type(self).__name__} computes its attention itself, not through transformers' attention interface, "
                f"so attn_implementation='mita' would be ignored; MiTA runs in models that use the interface "
                "(ViT, BERT, VideoMAE, ViViT, V-JEPA 2, ...), or convert this model's attention layers by hand"
            )
        if requested_attention == NAME and not is_init_check:  # set_attn_implementation on a built model
            _track_patch_grid(self)
        return get_correct_attn_implementation(self, requested_attention, is_init_check)

    checked.mita_checked = True
    return checked


def register() -> None:
    """Register ``"mita"`` with transformers (idempotent); done on import of this module."""
    AttentionInterface.register(NAME, mita_attention_forward)
    AttentionMaskInterface.register(NAME, mita_mask)
    original = PreTrainedModel.get_correct_attn_implementation
    if not getattr(original, "mita_checked", False):
        PreTrainedModel.get_correct_attn_implementation = _refuse_models_without_the_interface(original)
    if not getattr(PreTrainedModel.post_init, "mita_tracks", False):
        PreTrainedModel.post_init = _track_after_post_init(PreTrainedModel.post_init)


register()
