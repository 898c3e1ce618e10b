"""Peak memory of a smollm2c RL step, with and without gradient checkpointing.

Issue 34: two smollm2c runs share this 2-core, 23 GiB machine. Each holds about 4 GB between steps and
peaks far higher inside a step (the loss forward keeps every layer's activations for 16 rows of several
hundred tokens until the backward), and the kernel's OOM killer stopped a pilot run when two peaks met.
Gradient checkpointing keeps only the layers' inputs and recomputes the rest during the backward: less
memory for more compute. This measures both ways on the same steps: `otbrl train` with smollm2c's pilot
recipe (otb-N4 at 1e-5, the warm start, turn cache, float32, one thread) for a few steps from one seed,
each in its own process (peak RSS from the kernel's accounting of that process), the training seconds of
each step, and whether the two runs end with the same weights bit for bit (recomputed activations are the
same operations on the same inputs).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_step_memory.py   # docs/results/step-memory.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import command_line, markdown_table, write_result
from safetensors.torch import load_file

from otbrl.app.metrics import read_metrics
from otbrl.app.precision import cpu_flags
from studies.experiment import load_experiment, pilot_plan

SEED = 7  # not a seed of smollm2c's pilot or reported runs


def overrides(steps: int, checkpointing: bool, out: Path) -> dict:
    """smollm2c's first pilot run (otb-N4 at 1e-5) cut to `steps` steps, with no mid-run saves and a
    4-prompt closing evaluation (its 1,024-sample one would take longer than the steps)."""
    run = pilot_plan(load_experiment("smollm2c"), out)[0]
    return {
        **run.overrides,
        "seed": SEED,
        "max_steps": steps,
        "max_generated_tokens": None,
        "eval_before": False,
        "eval_at_tokens": [],
        "eval_size": 4,  # a run ends with a held-out evaluation: the smallest, so it costs seconds
        "eval_samples": 1,
        "save_steps": 10_000,
        "output_dir": str(out),
        "gradient_checkpointing": checkpointing,
    }


def train(keys: dict) -> dict:
    """One `otbrl train` process: its peak RSS (GiB), CPU seconds and wall seconds."""
    args = [sys.executable, "-m", "otbrl.app.cli", "train", "--config", "smollm2-draws"]
    for key, value in keys.items():
        text = json.dumps(value) if isinstance(value, dict | list | bool) or value is None else str(value)
        args += [f"--{key}", text]
    log = Path(keys["output_dir"] + ".log")
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ})
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"otbrl train failed (log: {log})")
    return {
        "peak_gib": usage.ru_maxrss / 2**20,  # the kernel reports kB
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    quick, out_page, threads = command_line(
        __doc__.split("\n\n")[0], "2 steps instead of 4", "step-memory.md"
    )
    steps = 2 if quick else 4
    order = [False, True] if quick else [False, True, True, False]  # ABBA: order and load even out
    folder = Path(tempfile.mkdtemp(prefix="step-memory-"))
    rows, done = [], []
    for i, checkpointing in enumerate(order):
        out = folder / f"{i}-{'checkpointing' if checkpointing else 'plain'}"
        measured = train(overrides(steps, checkpointing, out))
        metrics = read_metrics(out / "metrics.jsonl")
        seconds = [r["train_seconds"] for r in metrics]
        per_step = [b - a for a, b in zip([0.0, *seconds], seconds, strict=False)]
        later = sum(per_step[1:]) / max(1, len(per_step) - 1)
        done.append((checkpointing, out, metrics, measured))
        rows.append(
            [
                i + 1,
                "on" if checkpointing else "off",
                f"{measured['peak_gib']:.2f}",
                f"{later:.1f}",
                f"{measured['cpu_s']:.0f}",
                f"{metrics[-1]['generated_tokens']:.0f}",
            ]
        )
    first = load_file(str(done[0][1] / "final" / "model.safetensors"))
    same, diff = True, 0.0
    for _, out, _metrics, _ in done[1:]:
        w = load_file(str(out / "final" / "model.safetensors"))
        same &= all(torch.equal(first[k], w[k]) for k in first)
        diff = max(diff, max((first[k] - w[k]).abs().max().item() for k in first))
    same_rows = all(
        x[k] == y[k]
        for _, _, metrics, _ in done[1:]
        for x, y in zip(done[0][2], metrics, strict=True)
        for k in ("reward", "loss", "grad_norm")
    )

    def mean(key: str, on: bool) -> float:
        values = [m[key] for c, _, _, m in done if c == on]
        return sum(values) / len(values)

    flags = cpu_flags()
    head = [
        "process",
        "gradient checkpointing",
        "peak RSS (GiB)",
        "train s/step (steps 2+)",
        "CPU s",
        "tokens",
    ]
    description = (
        "smollm2c's pilot recipe (otb-N4 at 1e-5: chat_draws_told, the 10-step warm start, 4 prompts x 4, "
        f"turn cache, float32), seed {SEED}, {steps} steps and a 4-prompt closing evaluation, each in its "
        f"own process, in the order {', '.join('on' if c else 'off' for c in order)} (peak RSS: the "
        "kernel's high-water mark of the process, model loading included; CPU s: the process's user and "
        "system time). Seconds per step leave out step 1 (first-call costs) and include waiting for a core "
        f"when the machine is shared (the load average above). CPU flags: avx512_bf16 "
        f"{'avx512_bf16' in flags}, amx_bf16 {'amx_bf16' in flags} (float32 here)."
    )
    verdict = (
        f"Same weights after {steps} steps in every process, bit for bit: {same} (largest difference "
        f"{diff:.1e}); the same reward, loss and grad norm at every step: {same_rows}. Gradient "
        f"checkpointing, mean of its processes against the others': peak RSS {mean('peak_gib', True):.2f} "
        f"GiB against {mean('peak_gib', False):.2f}, CPU {mean('cpu_s', True):.0f} s against "
        f"{mean('cpu_s', False):.0f}."
    )
    write_result(
        out_page,
        "Peak memory of a smollm2c RL step, with and without gradient checkpointing (issue 34)",
        "bench_step_memory.py",
        quick,
        threads,
        description,
        markdown_table(head, rows),
        verdict,
        env="OMP_NUM_THREADS=1 ",
    )
    print(out_page.read_text())


if __name__ == "__main__":
    main()
