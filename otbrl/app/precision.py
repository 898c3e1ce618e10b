"""`bf16: auto`: bf16 autocast only where the hardware computes bf16 natively. On a CPU without AVX-512
BF16 or AMX, bf16 is emulated and a real-model step is several times slower than float32 (measured on an
AVX2-only AMD EPYC: 338 s against 48 s a SmolLM2 step), so there auto means float32."""

from __future__ import annotations

from pathlib import Path

import torch

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not exist: not Linux)."""
    if not cpuinfo.is_file():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def bf16_support(use_cpu: bool = False, flags: set[str] | None = None) -> tuple[bool, str]:
    """(whether bf16 autocast runs natively where training runs, the reason in words)."""
    if torch.cuda.is_available() and not use_cpu:
        name = torch.cuda.get_device_name()
        native = torch.cuda.is_bf16_supported()
        return native, f"{name} {'supports' if native else 'lacks'} bf16"
    flags = cpu_flags() if flags is None else flags
    native = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
    if native:
        return True, f"this CPU computes bf16 natively ({', '.join(native)})"
    return False, "this CPU has no native bf16 (no amx_bf16 or avx512_bf16): bf16 would be emulated"


def resolve_bf16(value: object, use_cpu: bool = False) -> tuple[object, str | None]:
    """A recipe's `bf16` value with "auto" resolved to a bool, and the reason (None if not auto)."""
    if not (isinstance(value, str) and value.strip().lower() == "auto"):
        return value, None
    native, why = bf16_support(use_cpu)
    return native, f"bf16: auto -> {'bf16 autocast' if native else 'float32'} ({why})"
