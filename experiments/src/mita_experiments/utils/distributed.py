"""The ``torchrun`` / DDP setup every trainer shares."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Dist", "init_distributed"]


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


def init_distributed(device: str | None = None) -> Dist:
    """Join the ``torchrun`` process group if its environment is set (NCCL on CUDA, gloo on CPU).

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (default: CUDA if available). Under
            torchrun a CUDA device becomes ``cuda:LOCAL_RANK``.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
