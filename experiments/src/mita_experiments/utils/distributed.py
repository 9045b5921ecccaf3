"""The ``torchrun`` / DDP setup every trainer shares."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["Dist", "distributed", "init_distributed", "parse_device"]

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """This process's place in a (possibly single-process) run: ``rank`` of ``world`` on ``device``."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        """Whether this is rank 0, the process that writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (identity in one process)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 only; every rank returns its result, or raises the error it raised
        (so a refusal on rank 0 stops every rank with the same message instead of a hang)."""
        outcome: list[Any] = [None]
        if self.main:
            try:
                outcome = [(True, fn())]
            except Exception as err:
                if self.world == 1:
                    raise
                outcome = [(False, err)]
        if self.world > 1:
            dist.broadcast_object_list(outcome, src=0)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


def parse_device(device: str | None) -> torch.device:
    """``device`` ("cpu", "cuda", "cuda:N", "mps"; default: CUDA if available) as a torch.device;
    a ValueError names a device that does not exist or is not available here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    elif dev.type not in ("cpu", "mps"):
        raise ValueError(f"--device {device}: only cpu, cuda and mps devices are supported")
    return dev


def init_distributed(device: str | None = None) -> Dist:
    """Join the ``torchrun`` process group if its environment is set (NCCL on CUDA, gloo on CPU).

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (default: CUDA if available); checked by
            :func:`parse_device`. Under torchrun a CUDA device becomes ``cuda:LOCAL_RANK``.
    """
    dev = parse_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(0, 1, dev)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
    return Dist(rank, world, dev)


@contextlib.contextmanager
def distributed(device: str | None = None) -> Iterator[Dist]:
    """:func:`init_distributed` for a command's lifetime: the process group it joined is closed at the
    end, the command's objects that hold it (a DDP wrapper, in reference cycles) freed first.

    Left open, the group's gloo threads outlived the interpreter: one of them freed a finished
    collective's tensors during shutdown and aborted its rank ("terminate called without an active
    exception"), one two-process run in 8 to 12 on two cores.
    """
    joined = not dist.is_initialized()
    ctx = init_distributed(device)
    try:
        yield ctx
    finally:
        if joined and dist.is_initialized():  # (a one-process run joined none)
            gc.collect()
            dist.destroy_process_group()
