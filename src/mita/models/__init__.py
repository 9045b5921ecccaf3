"""Whole networks with MiTA: :mod:`~mita.models.convert` (any timm ViT) and :mod:`~mita.models.deit`
(the MiTA-DeiT models in timm's registry). Both need timm; nothing here is imported by ``import mita``.
:mod:`~mita.models.segmenter`: Segmenter (semantic segmentation) with any registered attention."""
