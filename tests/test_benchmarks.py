"""The benchmark scripts still run (their --quick mode) and write their tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "expect"),
    [("bench_advantages.py", "otb/grpo"), ("bench_energy.py", "chunked"), ("energy_accuracy.py", "otbrl.lm")],
)
def test_benchmark_quick_mode_writes_its_table(tmp_path, script, expect):
    out = tmp_path / "result.md"
    subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
        check=True,
        cwd=BENCH,
        capture_output=True,
        timeout=300,
    )
    text = out.read_text()
    assert expect in text
    assert "|--" in text.replace(":", "-")  # a markdown table
    assert "Regenerate" in text


def test_gpu_benchmark_says_it_needs_cuda_on_a_machine_without_one():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    run = subprocess.run(
        [sys.executable, str(BENCH / "bench_fused_gpu.py"), "--quick"],
        cwd=BENCH,
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr
