"""What every results page is made of, shared by the studies, training and benchmarks/: the machine it was
measured on, markdown tables (the one table writer), a mean ± sd cell, and the committed data behind a page
(gzip JSON that gives the same bytes for the same content). Page prose lives with each study."""

from __future__ import annotations

import gzip
import json
import math
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def machine(threads: int) -> str:
    """CPU, memory, versions, torch threads and the load at the time of writing (other work on the
    machine slows every measurement)."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = ""
    if hasattr(os, "getloadavg"):
        load = f"; 1-minute load average {os.getloadavg()[0]:.2f} when written"
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {mem_gib:.0f} GiB RAM; Python {platform.python_version()}, "
        f"torch {torch.__version__}, torch threads {threads}{load}"
    )


def markdown_table(header: Sequence[object], rows: Sequence[Sequence[object]], aligned: bool = True) -> str:
    """A markdown table. aligned: cells right-justified to a common width (reads well when printed);
    otherwise compact `| a | b |` rows, for tables whose cells are long prose."""
    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"rows: every row needs {len(header)} cells, one per header column")
    if not aligned:
        cells = ["| " + " | ".join(map(str, r)) + " |" for r in (header, *rows)]
        return "\n".join([cells[0], "|" + "---|" * len(header), *cells[1:]])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def mean_sd(values: Sequence[float | None]) -> str:
    """'mean ± sd' over the values that are numbers (None and NaN dropped), '—' if none; values of
    1000 or more in thousands ('12.3k')."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    if not kept:
        return "—"
    mean = statistics.fmean(kept)
    fmt = (lambda v: f"{v / 1000:.1f}k") if abs(mean) >= 1000 else (lambda v: f"{v:.3f}")
    return fmt(mean) + (f" ± {fmt(statistics.stdev(kept))}" if len(kept) > 1 else "")


def write_record(path: Path, record: dict[str, Any]) -> None:
    """gzip with a fixed header time: the same record gives the same bytes (no spurious diffs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = json.dumps(record, separators=(",", ":")).encode()
    with path.open("wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:  # no name, no time
        f.write(blob)


def read_record(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)
