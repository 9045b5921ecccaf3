"""Shared test fixtures: devices to parametrize over, and seeded RNG."""

from __future__ import annotations

import pytest
import torch

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]  # fmt: skip


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
