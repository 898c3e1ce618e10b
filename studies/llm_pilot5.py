"""The fifth round of issue 34's task pilot: a supervised warm start first. Pilots 1-4 measured
SmolLM2-135M-Instruct (the registry's 4-bit GGUF) untrained and qualified no candidate: on every problem
space of >= 1,000 problems it solved 3-9% (docs/results/llm-pilot4.md; answers often off-topic). The
issue's fallback idea: teach the answer's form on the training side, then start RL there.

Candidates, fixed before this pilot ran: (task, warm-start steps), each a fresh `otbrl sft`
(otbrl/app/sft.py) of the untrained model on worked solutions of the task's training side only
(otbrl.tasks.worked: styles steps / whole / brief drawn 0.5 / 0.25 / 0.25, so answers for one problem differ
in length), learning rate 2e-5 constant, 8 solutions a step, seed 0, float32, 1 thread:
    chat_addlist_work  two to five numbers 1-9, asking for the working; 1,992 problems    8 and 32 steps
    chat_pair          two numbers 1-50 ("What is 23 + 38?"); 1,275 problems             8 and 32 steps
A try of 3 steps on chat_addlist_work (before this pilot, its accuracy not measured) took the completion loss
from 1.09 to 0.35, so a few steps already teach the form; 32 steps is 256 solutions.

Measurement: that of studies/llm_pilot2.py (64 distinct problems x 4 samples, T=1, then T=0.7 only if no
candidate qualifies at T=1, the chat template, otbrl's sampler in float32, at most 128 new tokens,
1 thread), with one change: the problems are drawn from the held-out side, which no warm start saw (the
starting accuracy a later experiment's evaluation reads).

Rule, pick and fallback: exactly llm_pilot2's (>= 1,000 problems, >= 250 held out, accuracy in
[0.15, 0.50], within-group length CV >= 0.30, at most 30% at the cap; the highest CV among those; T=1 first;
then the fallback, provisional). The pick names a task and a warm-start length; the experiment then
starts every run from that warm start (its weights' digest recorded).

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot5          # ~1 h: docs/results/llm-pilot5.md
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot5 --quick  # 1 step, 4 problems x 4, temp file
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from otbrl.app.recipe import load_recipe
from otbrl.app.sft import warm_start_chat
from otbrl.app.sources import choose_model, load_model
from studies.llm_pilot2 import (
    GROUP,
    PROBLEMS,
    READING,
    RULE,
    TEMPERATURES,
    pick,
    probe,
    qualifies,
    space,
    write_page,
)
from studies.pages import command_line

CANDIDATES = (("chat_addlist_work", 8), ("chat_addlist_work", 32), ("chat_pair", 8), ("chat_pair", 32))
LEARNING_RATE, BATCH, SEED = 2e-5, 8, 0
NUMBER = 5


def label(task: str, steps: int) -> str:
    return f"{task} + sft {steps}"


def warm(task: str, steps: int, where: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The candidate's warm start (trained once, kept in `where`), loaded; and its summary."""
    recipe = choose_model(load_recipe("smollm2-addlist", {"task": task}), print)
    final = where / "final"
    if not (where / "sft-summary.json").is_file():  # written last: a killed build has none
        warm_start_chat(recipe, steps, where, learning_rate=LEARNING_RATE, batch_size=BATCH, seed=SEED)
    model, tokenizer = load_model({**recipe, "model": str(final)}, print)
    summary = json.loads((where / "sft-summary.json").read_text())
    digest = hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()[:16]
    return model.eval(), tokenizer, {**summary, "weights": digest}


def main() -> None:
    quick, out, _ = command_line(
        "Real-model task pilot 5 of issue 34", "1 warm-start step, 4 problems per candidate", "llm-pilot5.md"
    )
    torch.set_num_threads(1)
    problems = 4 if quick else PROBLEMS
    candidates = CANDIDATES[:1] if quick else CANDIDATES
    scratch = Path("runs/llm-pilot5-quick" if quick else "runs/llm-pilot5")
    results: dict[tuple[str, float], dict[str, Any]] = {}
    warm_starts: dict[str, dict[str, Any]] = {}
    for temperature in TEMPERATURES:
        if any(qualifies(r, RULE) for r in results.values()):
            break
        for task, steps in candidates:
            steps = 1 if quick else steps
            started = time.perf_counter()
            model, tokenizer, about = warm(task, steps, scratch / f"{task}-sft{steps}")
            warm_starts[label(task, steps)] = about
            total, heldout = space(task)
            r = {
                "problems": total,
                "heldout": heldout,
                **probe(model, tokenizer, task, problems, temperature, True),
            }
            results[label(task, steps), temperature] = r
            print(
                f"{label(task, steps)} T={temperature}: accuracy {r['accuracy']:.3f} ± "
                f"{r['accuracy_se']:.3f}, median {r['median']}, CV {r['cv']:.3f}, capped {r['capped']:.2f}, "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )
    chosen, tier = pick(results)
    starts = "; ".join(
        f"{name}: {a['seconds']:.0f} s, loss {a['loss_first']:.2f} -> {a['loss_last']:.2f}, weights "
        f"{a['weights']}"
        for name, a in warm_starts.items()
    )
    description = (
        f"SmolLM2-135M-Instruct from the registry's GGUF, warm-started by `otbrl sft` on worked solutions "
        f"of each task's training side (learning rate {LEARNING_RATE:g}, {BATCH} a step, seed {SEED}, "
        f"float32, 1 thread; {starts}); {problems} distinct **held-out** problems x {GROUP} samples per "
        "candidate and temperature (stage 2 at T=0.7 only when no candidate qualified at T=1), chat "
        "template (no system prompt), otbrl's sampler in float32, at most 128 new tokens, 1 thread. "
        + READING
    )
    write_page(out, NUMBER, quick, description, results, chosen, tier)


if __name__ == "__main__":
    main()
