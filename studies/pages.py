"""What every results page is made of, shared by the studies, training and benchmarks/: the machine it was
measured on, markdown tables (the one table writer), a mean ± sd cell, and the committed data behind a page
(gzip JSON that gives the same bytes for the same content). Page prose lives with each study."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(threads: int) -> str:
    """CPU, memory, versions, torch threads and the load at the time of writing (other work on the
    machine slows every measurement)."""
    cpu = cpu_name()
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


def kilo(tokens: float) -> str:
    """12000 -> '12k' (token budgets in page text)."""
    return f"{tokens / 1000:g}k"


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


RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"  # the repository's docs/results


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
    """Write a results page: title, machine, the command that regenerates it (`script`: a file of
    benchmarks/, or "-m studies.NAME"; after `env`, e.g. "OMP_NUM_THREADS=1 "), what was measured, the
    table and the verdict computed from it."""
    where = script if script.startswith("-m ") else f"benchmarks/{script}"  # a suite module, or a script
    command = f"{env}.venv/bin/python {where}" + (" --quick" if quick else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"# {title}\n\nMachine: {machine(threads)}.\n\nRegenerate (from the repo root): `{command}`\n\n"
        f"{description}\n\n{table}\n\n{verdict}\n"
    )
    print(f"wrote {out}")
