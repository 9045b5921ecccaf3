"""Vision transformers with MiTA: FLOP tables and the paper's vision experiments.

``flops`` (FLOP and parameter tables), ``digits`` (the offline testbed: a small ViT on
scikit-learn's digits), ``experiments`` (attention swap, robustness over m and k, token
pruning), ``train`` (the ImageNet recipe) and ``cli`` (``mita vision ...``).
"""
