"""Whole networks with MiTA, all needing timm (nothing here is imported by ``import mita``):
:mod:`~mita.models.convert` (any timm ViT), :mod:`~mita.models.deit` (the MiTA-DeiT models in
timm's registry), :mod:`~mita.models.vit5` (ViT-5 and MiTA-ViT-5), :mod:`~mita.models.weights`
(their shared pretrained config and local-checkpoint loading) and :mod:`~mita.models.segmenter`
(Segmenter, semantic segmentation, with any registered attention)."""
