"""Semantic segmentation (mita_experiments.segmentation): the mIoU accumulation against a brute-force count,
ADE20K in its release layout on small files written in the real format, the transforms under a seed,
the generated scenes, the offline experiment, the FLOP table, ``mita bench seg`` and ``mita seg train|eval``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("timm")
pytest.importorskip("PIL")

from mita_experiments.segmentation.ade20k import (
    ADE20K,
    EvalTransform,
    TrainTransform,
    find_root,
    reduce_zero_label,
)
from mita_experiments.segmentation.metrics import ConfusionMatrix
from mita_experiments.segmentation.scenes import NUM_CLASSES, SIZE, load_scenes
from mita_experiments.segmentation.task import SegmentationScores
from mita_experiments.vision.digits import Tensors

# --- metrics ------------------------------------------------------------------------------


def brute_force(batches, num_classes, ignore=255):
    """Per-class IoU, mIoU and pixel accuracy by counting pixels class by class over all batches."""
    inter, union, right, total = [0] * num_classes, [0] * num_classes, 0, 0
    for prediction, label in batches:
        for p, t in zip(prediction.flatten().tolist(), label.flatten().tolist()):
            if t == ignore:
                continue
            total += 1
            right += p == t
            for c in range(num_classes):
                inter[c] += p == c and t == c
                union[c] += p == c or t == c
    iou = [i / u if u else math.nan for i, u in zip(inter, union)]
    seen = [v for v in iou if not math.isnan(v)]
    return iou, sum(seen) / len(seen), right / total


def test_miou_sums_over_the_data_set():
    g = torch.Generator().manual_seed(0)
    batches = []
    for size in ((2, 5, 7), (1, 3, 4), (3, 6, 6)):
        label = torch.randint(0, 5, size, generator=g)  # class 5 never labelled; 6 never anything
        label[torch.rand(size, generator=g) < 0.2] = 255
        prediction = torch.randint(0, 6, size, generator=g)
        batches.append((prediction, label))
    matrix = ConfusionMatrix(7)
    for prediction, label in batches:
        matrix.update(prediction, label)
    iou, miou, accuracy = brute_force(batches, 7)
    got = matrix.compute()
    assert got["mIoU"] == pytest.approx(miou, abs=1e-12)
    assert got["pixel_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    np.testing.assert_allclose(matrix.iou().numpy(), np.array(iou), atol=1e-12)  # NaN where never seen
    assert math.isnan(iou[6]) and iou[5] == 0.0
    per_image = [brute_force([b], 7)[1] for b in batches]
    assert abs(sum(per_image) / len(per_image) - miou) > 1e-3  # not a mean of per-image mIoUs


def test_miou_takes_logits_and_refuses_bad_input():
    matrix = ConfusionMatrix(3)
    logits = torch.tensor([[[[5.0]], [[0.0]], [[1.0]]]])  # (1, 3, 1, 1): class 0
    matrix.update(logits, torch.tensor([[[0]]]))
    assert matrix.compute()["mIoU"] == 1.0
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\)"):
        matrix.update(torch.zeros(1, 2, 2), torch.full((1, 2, 2), 3))
    with pytest.raises(ValueError, match="differ in shape"):
        matrix.update(torch.zeros(1, 2, 2), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="no labelled pixel"):
        ConfusionMatrix(3).compute()
    with pytest.raises(ValueError, match="num_classes"):
        ConfusionMatrix(0)


def test_scores_ignore_unlabelled_pixels():
    class Fixed(torch.nn.Module):
        def forward(self, images):
            logits = torch.zeros(len(images), 3, 2, 2)
            logits[:, 1] = 1.0  # class 1 everywhere
            return logits

    labels = torch.tensor([[[1, 0], [255, 255]]])
    s = SegmentationScores()(Fixed().eval(), (torch.zeros(1, 3, 2, 2), labels))
    assert float(s.count) == 2 and float(s.metrics["accuracy"]) == 1


# --- ADE20K -------------------------------------------------------------------------------


def write_ade20k(root: Path, sizes=((40, 56), (48, 48), (36, 60)), val=((44, 52), (40, 40))) -> Path:
    """ADEChallengeData2016 with JPEG images and 8-bit PNG label maps (0 = other, 1..150) of the given sizes."""
    from PIL import Image

    g = np.random.default_rng(0)
    top = root / "ADEChallengeData2016"
    for split, shapes, prefix in (("training", sizes, "ADE_train"), ("validation", val, "ADE_val")):
        (top / "images" / split).mkdir(parents=True)
        (top / "annotations" / split).mkdir(parents=True)
        for i, (h, w) in enumerate(shapes, 1):
            stem = f"{prefix}_{i:08d}"
            Image.fromarray(g.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(top / "images" / split / f"{stem}.jpg")
            label = np.zeros((h, w), dtype=np.uint8)
            label[: h // 2] = g.integers(1, 151)
            label[h // 2 :, : w // 2] = 150
            label[h // 2 :, w // 2 :] = g.integers(0, 151, (h - h // 2, w - w // 2))
            Image.fromarray(label, mode="L").save(top / "annotations" / split / f"{stem}.png")
    return top


def test_ade20k_release_layout(tmp_path):
    top = write_ade20k(tmp_path)
    assert find_root(tmp_path) == top and find_root(top) == top
    train = ADE20K(tmp_path, "training")
    assert len(train) == 3 and len(ADE20K(top, "validation")) == 2 and len(ADE20K(top, "training", limit=2)) == 2
    image, label = train[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 40, 56) and label.shape == (40, 56)
    assert label.dtype == torch.int64 and label[-1, 0] == 149  # 150 -> 149
    assert set(label.unique().tolist()) <= set(range(150)) | {255}
    from PIL import Image

    raw = torch.from_numpy(np.array(Image.open(top / "annotations/training/ADE_train_00000001.png")))
    assert torch.equal(label, reduce_zero_label(raw))
    assert torch.equal(reduce_zero_label(torch.tensor([0, 1, 150], dtype=torch.uint8)), torch.tensor([255, 0, 149]))
    assert train.digest() == ADE20K(tmp_path, "training").digest()


def test_ade20k_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="release layout"):
        find_root(tmp_path)
    top = write_ade20k(tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        ADE20K(top, "test")
    (top / "annotations/validation/ADE_val_00000002.png").unlink()
    with pytest.raises(FileNotFoundError, match="label map"):
        ADE20K(top, "validation")


def test_train_transform_is_deterministic_under_a_seed():
    g = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 60, 90), dtype=torch.uint8, generator=g)
    label = torch.randint(0, 5, (60, 90), generator=g)
    transform = TrainTransform(crop=32, scale=(128, 48))
    a = transform(image, label, torch.Generator().manual_seed(7))
    b = transform(image, label, torch.Generator().manual_seed(7))
    c = transform(image, label, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == (3, 32, 32) and a[1].shape == (32, 32) and a[0].dtype == torch.float32
    torch.manual_seed(3)  # the global RNG (which the trainer seeds) when no generator is given
    d = transform(image, label)
    torch.manual_seed(3)
    assert torch.equal(transform(image, label)[0], d[0])


def test_train_transform_pads_and_keeps_labels():
    image = torch.full((3, 20, 30), 100, dtype=torch.uint8)
    label = torch.arange(600).reshape(20, 30) % 7
    out, target = TrainTransform(crop=64, scale=(30, 20), ratio_range=(1.0, 1.0), photometric=False)(image, label)
    assert out.shape == (3, 64, 64) and (target[20:] == 255).all() and (target[:, 30:] == 255).all()
    assert (out[:, 20:] == 0).all()
    assert set(target[:20, :30].unique().tolist()) <= set(range(7))


def test_crop_category_ratio_rule():
    """Left half class 0, right half class 1: a 32 px crop is drawn again while one class fills 75% or more."""
    label = torch.zeros(32, 64, dtype=torch.long)
    label[:, 32:] = 1
    transform = TrainTransform(crop=32)
    for seed in range(20):
        _, left = transform.crop_origin(label, torch.Generator().manual_seed(seed))
        right = left  # columns of class 1 in the crop
        assert max(right, 32 - right) / 32 < 0.75


def test_eval_transform_resizes_into_the_scale():
    image = torch.zeros(3, 40, 60, dtype=torch.uint8)
    label = torch.zeros(40, 60, dtype=torch.long)
    out, target = EvalTransform(scale=(128, 32))(image, label)
    assert out.shape == (3, 32, 48) and target.shape == (40, 60)


# --- generated scenes and the offline experiment ---------------------------------------------


def test_scenes_are_seeded_and_labelled():
    a, b, c = load_scenes(0, train=8, test=4), load_scenes(0, train=8, test=4), load_scenes(1, train=8, test=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])
    assert a[0].shape == (8, 3, SIZE, SIZE) and a[1].shape == (8, SIZE, SIZE) and a[3].shape == (4, SIZE, SIZE)
    assert a[1].min() == 0 and a[1].max() < NUM_CLASSES and (a[1] > 0).any()


def test_shape_masks():
    from mita_experiments.segmentation.scenes import SHAPES, shape_mask

    axis = torch.arange(-10.0, 11.0)
    dy, dx = torch.meshgrid(axis, axis, indexing="ij")
    masks = {kind: shape_mask(kind, dy, dx, 8.0) for kind in SHAPES}
    assert all(0 < int(m.sum()) < 21 * 21 for m in masks.values())
    assert masks["disc"][10, 10] and not masks["ring"][10, 10] and masks["ring"][10, 17]
    assert len({tuple(m.flatten().tolist()) for m in masks.values()}) == len(SHAPES)  # all differ
    with pytest.raises(ValueError, match="kind must be one of"):
        shape_mask("star", dy, dx, 8.0)


def test_tensors_dataset():
    pairs = Tensors(torch.zeros(4, 3, 2, 2), torch.zeros(4, 2, 2, dtype=torch.long))
    assert len(pairs) == 4 and pairs.__getitems__([0, 2])[0].shape == (2, 3, 2, 2)
    with pytest.raises(ValueError, match="2 inputs but 3 targets"):
        Tensors(torch.zeros(2, 3, 2, 2), torch.zeros(3, 2, 2))
