"""Integrations with other libraries (timm, Hugging Face transformers)."""
