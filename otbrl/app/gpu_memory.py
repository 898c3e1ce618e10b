"""One GPU shared by several training processes: each one's cap, and what each one held.

PyTorch's caching allocator keeps the memory a process freed for its own later use, and gives it back to
the GPU only when that process itself runs out. Sixteen runs started together on one 80 GB H100 filled it
(80,171 MiB in use) and the runs that came last failed with "CUDA error: out of memory" when creating
their context, or CUBLAS_STATUS_ALLOC_FAILED in their first backward (docs/results/gpu-crowd.md). A cap
per process (`torch.cuda.set_per_process_memory_fraction`) makes each allocator recycle its own cache
before it grows into the room of the others; it changes no number a run computes.

An equal share is right only when the runs need the same: with walk's N=4 and N=32 arms sixteen at once,
0.9/16 of an H100 (4.45 GiB) failed all eight N=32 runs in their first backward (gpu-crowd.md, try 3).
So a share is sized from each arm's measured peak where one is known (`sized_shares`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

ENV = "OTBRL_GPU_MEMORY_FRACTION"
SHARED = 0.9  # of the GPU, split between the processes; the rest is for their CUDA contexts
HEADROOM = 1.25  # times a measured peak: the allocator's slack, and batches a little longer than measured


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


def sized_shares(peaks: Sequence[float], jobs: int, total_gib: float) -> tuple[list[float], int]:
    """Caps for runs whose peaks (GiB, one per run, measured by earlier runs of the same arm on this kind
    of GPU) are known: each run gets HEADROOM x its peak as a fraction of the GPU, rounded up to 1e-4, and
    the number of runs that may run at once drops from `jobs` until any that many of them (the largest
    caps first) fit in SHARED of the GPU. Raises when one run alone does not fit."""
    if not peaks:
        return [], jobs
    caps = [math.ceil(HEADROOM * gib / total_gib * 1e4) / 1e4 for gib in peaks]
    if max(caps) > SHARED:
        raise ValueError(
            f"a run measured at {max(peaks):.2f} GiB needs {max(caps):.0%} of this {total_gib:.0f} GiB GPU "
            f"with {HEADROOM}x headroom, more than the {SHARED:.0%} runs may share"
        )
    largest = sorted(caps, reverse=True)
    fit = max(1, min(jobs, len(caps)))
    while fit > 1 and sum(largest[:fit]) > SHARED:
        fit -= 1
    return caps, fit


def peak_gib() -> float | None:
    """The most GPU memory this process's allocator held (GiB), or None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**30, 2)
