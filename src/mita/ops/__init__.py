"""Functional attention ops on (B, H, N, D) tensors, one module (or package) per method."""
