"""What every results page starts with and is made of: the machine it was measured on and aligned
markdown tables. Shared by the studies and by the scripts in benchmarks/."""

from __future__ import annotations

import os
import platform
from pathlib import Path

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


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table padded to aligned columns, so it also reads well when printed."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
