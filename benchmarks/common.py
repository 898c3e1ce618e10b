"""Shared by the benchmark scripts: peak memory and median time of one call in a fresh process,
machine description, and markdown tables.

Peak memory is read from /proc (Linux only): VmHWM after the call minus VmRSS just before it, with the
high-water mark reset by writing "5" to /proc/self/clear_refs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from otbrl.app.pages import machine


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


RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def command_line(description: str, quick_help: str, filename: str) -> tuple[bool, Path, int]:
    """Parse --quick / --out. Returns (quick, output path, torch threads). Quick runs write to the temp
    directory unless --out says otherwise, so they never overwrite the measured tables in docs/."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=f"{quick_help}; output to a temp file")
    parser.add_argument("--out", type=Path, help="markdown output path")
    args = parser.parse_args()
    out = args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS) / filename
    threads = torch.get_num_threads()
    print(machine(threads))
    return args.quick, out, threads


def write_result(
    out: Path,
    title: str,
    script: str,
    quick: bool,
    threads: int,
    description: str,
    table: str,
    verdict: str,
    env: str = "",
) -> None:
    """Write a results page: title, machine, the command that regenerates it (after `env`, e.g.
    "OMP_NUM_THREADS=1 "), what was measured, the table and the verdict computed from it."""
    command = f"{env}.venv/bin/python benchmarks/{script}" + (" --quick" if quick else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# {title}\n\nMachine: {machine(threads)}.\n\nRegenerate (from the repo root): `{command}`\n\n"
        f"{description}\n\n{table}\n\n{verdict}\n"
    )
    print(f"wrote {out}")
