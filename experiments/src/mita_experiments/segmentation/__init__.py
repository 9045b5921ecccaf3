"""Semantic segmentation: Segmenter (:mod:`mita.models.segmenter`) on ADE20K and on generated scenes,
mIoU, the attention swap, FLOPs and whole-model speed (``mita seg ...``, ``mita bench seg``)."""
