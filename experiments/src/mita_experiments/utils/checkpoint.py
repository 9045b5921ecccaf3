"""Checkpoints that load without running code, and model weights as safetensors.

A checkpoint holds only tensors and plain types (dict, list, tuple, str, int, float,
bool, None): :func:`save_checkpoint` refuses anything else before writing, and
:func:`load_checkpoint` reads with ``torch.load(weights_only=True)``, so a crafted file
is refused instead of run. Weights users exchange are written as safetensors.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .files import atomic_write

__all__ = ["load_checkpoint", "load_weights", "plain", "save_checkpoint", "save_weights"]

_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def plain(obj: Any, where: str = "checkpoint") -> Any:
    """``obj`` if it holds only tensors and plain types (tuples kept), else a TypeError naming the part."""
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}; keys must be str or int")
            plain(value, f"{where}[{key!r}]")
        return obj
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            plain(value, f"{where}[{i}]")
        return obj
    raise TypeError(f"{where} is a {type(obj).__name__}; a checkpoint stores only tensors and plain types")


def save_checkpoint(state: Mapping[str, Any], path: str | os.PathLike) -> None:
    """``torch.save`` ``state`` (tensors and plain types only) to ``path`` atomically (fsynced).

    It is serialised in memory first, so a failed write (a full disk) is an OSError naming
    the file and saying it was left as it was, not torch's internal error."""
    plain(state)
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    with atomic_write(path) as f:
        f.write(buffer.getbuffer())


def load_checkpoint(path: str | os.PathLike, what: str = "checkpoint") -> dict[str, Any]:
    """The dict saved at ``path``, loaded with ``weights_only=True`` onto the CPU.

    A missing file raises FileNotFoundError; an empty, truncated or corrupt file, or one
    holding objects other than tensors and plain types (which are never unpickled), a
    ValueError naming the file and the fault.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} not found")
    if path.stat().st_size == 0:
        raise ValueError(f"{what} {path} is empty (0 bytes); it was not written completely")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{what} {path} holds objects other than tensors and plain types; refused without running them "
            f"(only checkpoints written by mita load): {first}"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError, IndexError) as err:
        raise ValueError(f"{what} {path} is truncated or corrupt: {type(err).__name__}: {err}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{what} {path} holds a {type(state).__name__}, not a dict of a checkpoint")
    return state


def save_weights(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """Write a state dict as safetensors (atomically); shared tensors are copied apart."""
    from safetensors.torch import save

    data = save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, metadata=metadata)
    with atomic_write(path) as f:
        f.write(data)


def load_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict and the metadata of a safetensors file (never runs code); a corrupt file
    is a ValueError naming it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} not found")
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types for every fault of the format
        raise ValueError(f"weights file {path} is not a valid safetensors file: {err}") from None
