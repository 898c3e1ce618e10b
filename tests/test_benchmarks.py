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


def test_gpu_step_verdict_reads_the_target_against_the_spread_of_identical_work():
    sys.path.insert(0, str(BENCH))
    try:
        from bench_gpu_step import verdict
    finally:
        sys.path.remove(str(BENCH))
    size, path = "Qwen2.5-1.5B", "generate"
    assert "met (worst 1.010x)" in verdict([(size, path, 1.01)], {(size, path): 1.2})
    # the third lease's numbers: 1.097x while steps of the same work differed by 1.118x between arms
    within = verdict([(size, path, 1.097)], {(size, path): 1.118})
    assert "not resolved" in within and "NOT met" not in within
    beyond = verdict([(size, path, 1.15)], {(size, path): 1.05})
    assert "NOT met" in beyond and "not resolved" not in beyond
    # one path beyond its spread is enough for NOT met; an unknown spread never excuses a ratio
    assert "NOT met" in verdict([(size, path, 1.05), (size, "rollout_func", 1.3)], {(size, path): 1.1})
    assert "no pair" in verdict([], {})
