"""Shared by the benchmark scripts: peak memory and median time of one call in a fresh process,
machine description, and markdown tables.

Peak memory is read from /proc (Linux only): VmHWM after the call minus VmRSS just before it, with the
high-water mark reset by writing "5" to /proc/self/clear_refs.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The scripts run from any directory; the page helpers they share with the evidence suite (the machine line,
# the one markdown table writer, compact records) live in the repository's `studies` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from studies.pages import (  # noqa: E402
    RESULTS,
    command_line,
    machine,
    markdown_table,
    read_record,
    write_record,
    write_result,
)

# re-exported for the scripts
__all__ = [
    "RESULTS",
    "command_line",
    "machine",
    "markdown_table",
    "read_record",
    "write_record",
    "write_result",
]


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def measure(call: Callable[[], Any], budget_s: float, min_repeats: int, max_repeats: int) -> dict[str, Any]:
    """Peak extra memory of the first call (which also serves as warm-up), then the median time of
    k further calls, k chosen so the timing takes about budget_s. Returns peak_mib, ms, repeats, out."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current VmRSS
    before = _status_mib("VmRSS")
    start = time.perf_counter()
    out = call()
    first = time.perf_counter() - start
    peak = _status_mib("VmHWM") - before
    repeats = max(min_repeats, min(max_repeats, int(budget_s / first)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
    return {"peak_mib": peak, "ms": 1e3 * statistics.median(times), "repeats": repeats, "out": out}


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a newly spawned interpreter, so no allocator state or earlier peak leaks into it.
    fn must be a module-level function and its result picklable."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)
