"""One GPU shared by several training processes: each one's cap, and what each one held.

PyTorch's caching allocator keeps the memory a process freed for its own later use, and gives it back to
the GPU only when that process itself runs out. Sixteen runs started together on one 80 GB H100 filled it
(80,171 MiB in use) and the runs that came last failed with "CUDA error: out of memory" when creating
their context, or CUBLAS_STATUS_ALLOC_FAILED in their first backward (docs/results/gpu-crowd.md). A cap
per process (`torch.cuda.set_per_process_memory_fraction`) makes each allocator recycle its own cache
before it grows into the room of the others; it changes no number a run computes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch

ENV = "OTBRL_GPU_MEMORY_FRACTION"
SHARED = 0.9  # of the GPU, split between the processes; the rest is for their CUDA contexts


def parse_fraction(value: str | None) -> float | None:
    """`OTBRL_GPU_MEMORY_FRACTION`'s value as a fraction in (0, 1]; None when unset or empty."""
    if value is None or not value.strip():
        return None
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"{ENV}: a fraction of the GPU's memory in (0, 1], got {value!r}") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"{ENV}: a fraction of the GPU's memory in (0, 1], got {value!r}")
    return fraction


def apply_share(log: Callable[[str], Any] = print) -> float | None:
    """Cap this process's GPU memory at `$OTBRL_GPU_MEMORY_FRACTION` of the GPU (checked everywhere, a
    no-op without CUDA). Returns the fraction applied, or None."""
    fraction = parse_fraction(os.environ.get(ENV))
    if fraction is None or not torch.cuda.is_available():
        return None
    torch.cuda.set_per_process_memory_fraction(fraction)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    log(f"GPU memory: this process may hold at most {fraction * total:.1f} of {total:.1f} GiB ({ENV})")
    return fraction


def share_env(jobs: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to give each of `jobs` processes that start together on one GPU: an equal share of
    `SHARED` of its memory. Empty for one job, or when the caller already chose a fraction."""
    environ = os.environ if environ is None else environ
    if jobs <= 1 or environ.get(ENV):
        return {}
    return {ENV: f"{math.floor(SHARED / jobs * 1e4) / 1e4:.4f}"}  # rounded down: the shares fit


def peak_gib() -> float | None:
    """The most GPU memory this process's allocator held (GiB), or None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**30, 2)
