"""What a measured number depends on: the machine, the threads, the versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

__all__ = ["describe", "machine_info", "memory_setup"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Process settings that move CPU timings: the allocator (glibc's heap trimming and mmap threshold, a
# preloaded jemalloc or tcmalloc) decides whether each call's outputs are fresh pages, which on a VM
# cost 1-2 us per 4 KiB page (docs/performance.md, "Fresh memory"); MITA_CPU_CACHE_MB is the limit of
# the freed outputs and scratch the fused MiTA kernels keep for reuse.
MEMORY_ENV = (
    "MITA_CPU_CACHE_MB",
    "LD_PRELOAD",
    "GLIBC_TUNABLES",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_CONF",
    "THP_MEM_ALLOC_ENABLE",
)


def memory_setup() -> str:
    """This process's allocator settings (``MEMORY_ENV``; preloaded libraries by file name) and the
    transparent huge pages mode, as one line; ``default allocator`` when none is set."""
    settings = []
    for name in MEMORY_ENV:
        if value := os.environ.get(name):
            if name == "LD_PRELOAD":
                value = " ".join(Path(lib).name for lib in value.replace(":", " ").split())
            settings.append(f"{name}={value}")
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().split()
        thp = [f"THP {mode.strip('[]')}" for mode in modes if mode.startswith("[")]
    except OSError:
        thp = []
    return ", ".join([*(settings or ["default allocator"]), *thp])


def machine_info(device: str = "cpu") -> dict[str, object]:
    """CPU model, cores, torch threads, versions and the CUDA device of ``device`` (default ``"cpu"``)."""
    cuda = device.startswith("cuda")
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "memory": memory_setup(),
        "device": device,
        "cuda_device": torch.cuda.get_device_name(device) if cuda else None,
        "cuda_version": torch.version.cuda if cuda else None,
    }


def describe(info: dict[str, object] | None = None) -> str:
    """One line of :func:`machine_info` (default: this machine, CPU) for reports."""
    info = info or machine_info()
    gpu = f", {info['cuda_device']} (CUDA {info['cuda_version']})" if info.get("cuda_device") else ""
    return (
        f"{info['cpu_model']} ({info['usable_cpus']} usable CPUs), {info['torch_threads']} torch threads, "
        f"Python {info['python']}, torch {info['torch']}, {info['platform']}, "
        f"{info.get('memory', 'memory not recorded')}{gpu}"
    )
