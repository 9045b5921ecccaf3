"""Video: moving digits (an offline video task), a small video ViT, the swap and robustness
experiments on it, and VideoMAE speed and FLOP tables (``mita video``)."""
