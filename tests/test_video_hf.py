"""Hugging Face video encoders with attn_implementation="mita": tiny random VideoMAE, ViViT, V-JEPA 2."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    TimesformerConfig,
    TimesformerModel,
    VideoMAEConfig,
    VideoMAEForPreTraining,
    VideoMAEForVideoClassification,
    VideoMAEModel,
    VideoPrismVisionConfig,
    VideoPrismVisionModel,
    VivitConfig,
    VivitForVideoClassification,
    VJEPA2Config,
    VJEPA2ForVideoClassification,
    VJEPA2Model,
)

from mita.integrations.hf import mita_options  # noqa: E402
from test_hf import capture_self_attention, expected_attention  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def videomae_config(**kwargs) -> VideoMAEConfig:
    """4 frames of 32 px, tubelets of 2 x 8 x 8: a (2, 4, 4) grid of 32 tokens, no CLS."""
    return VideoMAEConfig(**{**dict(image_size=32, patch_size=8, num_frames=4, tubelet_size=2), **SMALL, **kwargs})


def vjepa2_config(**kwargs) -> VJEPA2Config:
    args = dict(crop_size=32, patch_size=8, frames_per_clip=4, tubelet_size=2, num_pooler_layers=1)
    predictor = dict(pred_hidden_size=32, pred_num_attention_heads=2, pred_num_hidden_layers=1)
    return VJEPA2Config(**{**args, **predictor, **SMALL, **kwargs})


@pytest.mark.parametrize("cls", [VideoMAEModel, VideoMAEForVideoClassification])
def test_videomae_matches_the_op_on_a_3d_grid(cls):
    config = videomae_config(mita_num_landmarks=[1, 2, 2], mita_topk=6, qv_bias=False)
    model = cls._from_config(config, attn_implementation="mita").eval()
    calls = capture_self_attention(model, "VideoMAESelfAttention")
    video = torch.randn(2, 4, 3, 32, 32)
    with torch.no_grad():
        out = model(video)
        options = dict(num_landmarks=(1, 2, 2), topk=6, num_routed=1, grid=(2, 4, 4), num_prefix_tokens=0)
        assert len(calls) == 2
        for module, hidden, attended in calls:
            torch.testing.assert_close(attended, expected_attention(module, hidden, options))
        sdpa = cls._from_config(config, attn_implementation="sdpa").eval()
        sdpa.load_state_dict(model.state_dict())
        reference = sdpa(video)
    key = "logits" if "logits" in out else "last_hidden_state"
    assert not torch.allclose(out[key], reference[key])  # MiTA with 4 of 32 landmarks is not dense attention


def test_videomae_classifier_trains_a_step():
    model = VideoMAEForVideoClassification._from_config(videomae_config(num_labels=3), attn_implementation="mita")
    loss = model(torch.randn(2, 4, 3, 32, 32), labels=torch.tensor([0, 2])).loss
    loss.backward()
    assert torch.isfinite(loss) and model.videomae.embeddings.patch_embeddings.projection.weight.grad.abs().sum() > 0


def test_videomae_pretraining_pools_its_visible_tokens_in_1d():
    model = VideoMAEForPreTraining._from_config(videomae_config(), attn_implementation="mita").eval()
    visible = torch.zeros(2, 32, dtype=torch.bool)
    visible[:, ::2] = True  # the same number of masked tubelets per clip, as VideoMAE requires
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(2, 4, 3, 32, 32), bool_masked_pos=visible).logits).all()


@pytest.mark.parametrize(
    ("config", "n", "expected"),
    [
        (videomae_config(), 32, dict(num_landmarks=(2, 4, 4), topk=98, num_prefix_tokens=0, grid=(2, 4, 4))),
        (videomae_config(image_size=224, patch_size=16, num_frames=16), 1568, dict(num_landmarks=(2, 7, 7))),
        (videomae_config(), 16, dict(grid=None, num_landmarks=32)),  # masked: half the tokens, no grid
        (videomae_config(mita_num_landmarks=8, mita_grid=None), 32, dict(grid=None, num_landmarks=8)),
        (videomae_config(mita_grid=[8, 4]), 32, dict(grid=(8, 4), num_landmarks=(7, 4))),
        (
            VivitConfig(image_size=32, num_frames=4, tubelet_size=[2, 8, 8]),
            33,
            dict(grid=(2, 4, 4), num_prefix_tokens=1),
        ),
        (vjepa2_config(), 32, dict(grid=(2, 4, 4), num_prefix_tokens=0)),
        (vjepa2_config(), 64, dict(grid=None)),  # the predictor's context and target tokens
        (vjepa2_config(), 1, dict(grid=None, num_landmarks=32)),  # the pooler's query
    ],
    ids=["videomae", "videomae-base", "masked", "1d", "2d", "vivit-cls", "vjepa2", "predictor", "query"],
)
def test_video_options_from_config(config, n, expected):
    options = mita_options(config, n)
    assert {k: options[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("make", "video"),
    [
        (
            lambda: VivitForVideoClassification._from_config(
                VivitConfig(**SMALL, image_size=32, num_frames=4, tubelet_size=[2, 8, 8]), attn_implementation="mita"
            ),
            torch.randn(1, 4, 3, 32, 32),
        ),
        (lambda: VJEPA2Model._from_config(vjepa2_config(), attn_implementation="mita"), torch.randn(1, 4, 3, 32, 32)),
        (
            lambda: VJEPA2ForVideoClassification._from_config(vjepa2_config(), attn_implementation="mita"),
            torch.randn(1, 4, 3, 32, 32),
        ),
    ],
    ids=["vivit", "vjepa2", "vjepa2-classifier"],
)
def test_other_video_encoders_run(make, video):
    model = make().eval()
    with torch.no_grad():
        out = model(video)
    assert all(torch.isfinite(v).all() for v in out.values() if isinstance(v, torch.Tensor))


def test_models_without_the_attention_interface_are_refused_by_name():
    config = TimesformerConfig(image_size=32, patch_size=8, num_frames=4, **SMALL)
    with pytest.raises(ValueError, match="TimesformerModel computes its attention itself"):
        TimesformerModel._from_config(config, attn_implementation="mita")
    TimesformerModel._from_config(config, attn_implementation="eager")  # other implementations are untouched


def test_softcapped_attention_is_refused_by_name():
    config = VideoPrismVisionConfig(
        image_size=32,
        num_frames=2,
        tubelet_size=[1, 8, 8],
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        num_spatial_layers=1,
        num_temporal_layers=1,
    )
    model = VideoPrismVisionModel._from_config(config, attn_implementation="mita").eval()
    with pytest.raises(ValueError, match="soft-capping, which VideoPrismAttention"):
        model(torch.randn(1, 2, 3, 32, 32))


def test_wrapped_timm_models_are_refused():
    pytest.importorskip("timm")
    from transformers import TimmWrapperConfig, TimmWrapperModel

    config = TimmWrapperConfig(architecture="vit_tiny_patch16_224", model_args={"img_size": 32, "depth": 1})
    with pytest.raises(ValueError, match=r"mita\.convert"):
        TimmWrapperModel._from_config(config, attn_implementation="mita")
