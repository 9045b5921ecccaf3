"""Shared test fixtures: devices to parametrize over, and seeded RNG."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker (and its subprocesses): no oversubscribed cores
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
