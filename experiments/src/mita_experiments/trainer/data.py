"""Data order and loading: which samples each step takes, and how they are fetched.

The global batch of step t depends only on (seed, t): a slice of a permutation of the
training samples seeded by (seed, epoch) (:class:`StepSampler`). Each rank takes every
``world``-th sample of it and splits its share into ``accum`` micro-batches. Before a
micro-batch is fetched (in this process or in a DataLoader worker) the torch, Python and
NumPy RNGs are seeded from (seed, step, rank, micro-batch), so random augmentations do not
depend on the number of workers nor on where a run was resumed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["StepSampler", "derive_seed", "reseed", "tensor_digest", "to_device"]

#: tags that keep the seed streams apart
ORDER, FETCH, FORWARD, EVAL = 1, 2, 3, 4


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (NumPy's SeedSequence: nearby inputs give unrelated seeds)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def reseed(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and NumPy's global RNG from ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class StepSampler:
    """The global batch of each step: a slice of epoch ``step // steps_per_epoch``'s permutation.

    Args:
        num_samples: training samples (>= ``batch_size``).
        batch_size: samples per step over all ranks and micro-batches.
        seed: the permutation of epoch e is seeded by (seed, e).

    The remainder of an epoch (``num_samples % batch_size`` samples) is left out of that epoch.
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        if num_samples < batch_size:
            raise ValueError(
                f"train.batch_size={batch_size} exceeds the {num_samples} training samples; lower train.batch_size"
            )
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.steps_per_epoch = num_samples // batch_size
        self._cached: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of the samples in ``epoch``."""
        if self._cached is None or self._cached[0] != epoch:
            g = torch.Generator().manual_seed(derive_seed(ORDER, self.seed, epoch))
            self._cached = (epoch, torch.randperm(self.num_samples, generator=g))
        return self._cached[1]

    def __call__(self, step: int) -> torch.Tensor:
        """The sample indices (``batch_size``,) of ``step``."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[pos * self.batch_size : (pos + 1) * self.batch_size]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (in tuples, lists and dicts, at any depth) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(x, device) for x in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _identity(batch: Any) -> Any:
    return batch


class Fetcher:
    """Fetches the batch of a key (seed, indices) from a map-style dataset, RNGs seeded first.

    A dataset with ``__getitems__(indices)`` returns a batch itself (``collate``, if given, is
    applied to it); otherwise its samples ``dataset[i]`` are collated by ``collate`` (default:
    torch's ``default_collate``). Used in-process and as the dataset of a DataLoader whose
    batch sampler yields the keys.
    """

    def __init__(self, dataset: Any, collate: Callable[[Any], Any] | None) -> None:
        self.dataset, self.collate = dataset, collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, key: tuple[int, list[int]]) -> Any:
        seed, indices = key
        reseed(seed)
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            batch = getitems(indices)
            return batch if self.collate is None else self.collate(batch)
        from torch.utils.data import default_collate

        return (self.collate or default_collate)([self.dataset[i] for i in indices])


class _Keys:
    """A DataLoader batch sampler over precomputed keys."""

    def __init__(self, keys: Callable[[], Iterator[tuple[int, list[int]]]]) -> None:
        self.keys = keys

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        return self.keys()


def fetch_all(
    dataset: Any,
    keys: Callable[[], Iterator[tuple[int, list[int]]]],
    collate: Callable[[Any], Any] | None,
    workers: int,
    pin_memory: bool,
) -> Iterator[tuple[int, Any]]:
    """(number of samples, batch) for each key of ``keys()``, in order; ``workers`` > 0 loads them
    in DataLoader worker processes."""
    fetcher = Fetcher(dataset, collate)
    if workers == 0:
        for key in keys():
            yield len(key[1]), fetcher.__getitems__(key)
        return
    from torch.utils.data import DataLoader

    sizes = (len(key[1]) for key in keys())
    loader = DataLoader(
        fetcher, batch_sampler=_Keys(keys), collate_fn=_identity, num_workers=workers, pin_memory=pin_memory
    )
    yield from zip(sizes, loader)


def shard(indices: torch.Tensor, rank: int, world: int, parts: int) -> Sequence[torch.Tensor]:
    """This rank's share of a global batch (every ``world``-th sample) in ``parts`` micro-batches."""
    return indices[rank::world].chunk(parts)


def tensor_digest(*tensors: torch.Tensor | None) -> str:
    """A SHA-256 of the dtypes, shapes and contents of ``tensors`` (None counts as absent): a data fingerprint."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none;")
            continue
        array = np.ascontiguousarray(t.detach().cpu().numpy())
        h.update(f"{array.dtype.str}{array.shape};".encode())
        h.update(memoryview(array).cast("B"))
    return h.hexdigest()
