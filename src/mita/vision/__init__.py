"""Vision transformers with MiTA: FLOP tables and the paper's vision experiments."""
