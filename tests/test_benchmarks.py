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


def test_decay_timing_replays_the_detector_against_collapses():
    """benchmarks/decay_timing.py: a trigger counts as in time only at or before the collapse step, and a
    trigger in a run that never collapsed counts against the detector."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decay_timing", BENCH / "decay_timing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    settings = {"warmup": 5, "window": 20, "cooldown": 10, "zscore": 0.0}
    flat = [80.0] * 30
    surge = [80.0] * 10 + [200.0] * 20  # high from step 11: fires after `patience` (3) high steps, at 13
    assert mod.first_trigger(flat, settings) is None
    assert mod.first_trigger(surge, settings) == 13

    def run(lengths, collapse):  # noqa: ANN001, ANN202
        return {"steps": list(range(1, len(lengths) + 1)), "length": lengths, "collapse": collapse}

    runs = {"a": [run(surge, 15), run(surge, 12), run(flat, 20)], "b": [run(surge, None), run(flat, None)]}
    t = mod.timing(runs, settings)
    assert (t["caught"], t["late"], t["never"], t["false"], t["quiet"], t["lead"]) == (1, 1, 1, 1, 1, 2)


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
