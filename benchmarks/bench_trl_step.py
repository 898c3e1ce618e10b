"""What OTB costs per TRL training step: OTBGRPOTrainer with "otb" against the same trainer with a
group-mean estimator ("dr_grpo", no energy), num_iterations=2, on a 14M-parameter Qwen2 (hidden 384,
6 layers, character vocabulary), 32 completions of up to 24 tokens per step, one thread.

    .venv/bin/python benchmarks/bench_trl_step.py          # ~5 min, writes docs/results/trl_step.md
    .venv/bin/python benchmarks/bench_trl_step.py --quick  # a 2-layer model, few steps, to a temp file

Two generation paths:
  generate      TRL generates (transformers' generate); TRL computes old log-probs (num_iterations=2)
                and the energy comes out of that same forward ("old_logps").
  rollout_func  otbrl's sampler generates (otbrl.integrations.trl.rollout_func, no tools) and returns
                each token's energy with its log-prob ("sampler").
A third arm on the generate path, "otb + own forward", forces the separate no-grad energy forward that the
trainer used before (and still uses when no other pass exists), to show what the shared pass saves.

Arms alternate within each repeat (order reversed every other repeat), every run has the same seed and
weights, and the learning rate is 0 (every computation of a step runs, the weights stay put), so every arm
samples the very same completions and only the cost differs. A step runs from the Trainer's on_step_begin
to on_step_end (generation, scoring, the energy, advantages, forward and backward); the first 2 steps are
warm-up, the mean of the rest is kept.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import torch
from common import command_line, markdown_table, write_result
from datasets import Dataset
from step_clock import StepClock
from transformers import Qwen2Config, Qwen2ForCausalLM

from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer, rollout_func
from otbrl.tasks import char_tokenizer, dataset, get_task
from otbrl.tasks.models import tiny_config

TARGET = 1.03
TASK = get_task("add_reversed")


class OwnForward(OTBGRPOTrainer):
    """OTB with TRL's old-log-prob pass left alone: the energy takes its own no-grad forward."""

    def _tap_wanted(self) -> bool:
        return False


def make_model(layers: int, seed: int = 0) -> Qwen2ForCausalLM:
    """The tiny presets' Qwen2 (tied embeddings, character vocabulary), hidden 384 and `layers` layers."""
    small = tiny_config("small")
    config = Qwen2Config(
        vocab_size=small.vocab_size,
        hidden_size=384,
        intermediate_size=4 * 384,
        num_hidden_layers=layers,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=small.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=small.pad_token_id,
        bos_token_id=small.bos_token_id,
        eos_token_id=small.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    return [
        TASK.reward(c, a) + 0.1 * sum(ch.isdigit() for ch in c) / 24
        for c, a in zip(completions, answer, strict=True)
    ]


def run(arm: str, path: str, layers: int, steps: int) -> tuple[float, float, str | None]:
    """Mean CPU and wall time per step (s) after 2 warm-up steps, and where the energy came from."""
    estimator = "dr_grpo" if arm == "dr_grpo" else "otb"
    with tempfile.TemporaryDirectory() as out:
        args = OTBGRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            max_steps=steps,
            learning_rate=0.0,
            per_device_train_batch_size=32,
            num_generations=8,
            max_completion_length=24,
            num_iterations=2,
            beta=0.0,
            seed=0,
            disable_tqdm=True,
            advantage_estimator=estimator,
            temperature=1.0,
        )
        clock = StepClock()
        cls = OwnForward if arm == "otb + own forward" else OTBGRPOTrainer
        extra = {"rollout_func": rollout_func((), max_turns=0, workers=1)} if path == "rollout_func" else {}
        trainer = cls(
            model=make_model(layers),
            reward_funcs=reward,
            args=args,
            processing_class=char_tokenizer(),
            train_dataset=Dataset.from_list(dataset(TASK, 64, seed=0)),
            callbacks=[clock],
            **extra,
        )
        trainer.train()
    return statistics.mean(clock.cpu[2:]), statistics.mean(clock.wall[2:]), trainer.energy_source


def main() -> None:
    quick, out, _ = command_line("OTB's cost per TRL step", "a 2-layer model and 4 steps", "trl_step.md")
    torch.set_num_threads(1)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    layers, steps, repeats = (2, 4, 1) if quick else (6, 8, 2)
    params = sum(p.numel() for p in make_model(layers).parameters()) / 1e6
    paths = {"generate": ["dr_grpo", "otb", "otb + own forward"], "rollout_func": ["dr_grpo", "otb"]}
    times: dict[tuple[str, str], list[float]] = {}
    walls: dict[tuple[str, str], list[float]] = {}
    sources: dict[tuple[str, str], str | None] = {}
    for rep in range(repeats):
        for path, arms in paths.items():
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                t, wall, source = run(arm, path, layers, steps)
                times.setdefault((path, arm), []).append(t)
                walls.setdefault((path, arm), []).append(wall)
                sources[(path, arm)] = source
                print(
                    f"repeat {rep} {path:12s} {arm:18s} cpu {t:.3f} wall {wall:.3f} s/step ({source})",
                    flush=True,
                )

    rows, ratios = [], {}
    for path, arms in paths.items():
        base = times[(path, "dr_grpo")]
        for arm in arms:
            per_rep = [a / b for a, b in zip(times[(path, arm)], base, strict=True)]
            ratio = statistics.median(per_rep)
            ratios[(path, arm)] = ratio
            rows.append(
                [
                    path,
                    arm,
                    sources[(path, arm)] or "none",
                    " / ".join(f"{t:.2f}" for t in times[(path, arm)]),
                    f"{ratio:.3f}x",
                    " / ".join(f"{t:.2f}" for t in walls[(path, arm)]),
                ]
            )
    header = ["generation", "arm", "energy from", "CPU s/step (each repeat)", "CPU vs dr_grpo (median)"]
    table = markdown_table([*header, "wall s/step (each repeat)"], rows)
    shared = [ratios[("generate", "otb")], ratios[("rollout_func", "otb")]]
    verdict = (
        f"OTB step CPU time / dr_grpo step CPU time: {shared[0]:.3f}x with TRL generating (energy from the "
        f"old-log-prob pass), {shared[1]:.3f}x with otbrl's sampler (energy from sampling); "
        f"target <= {TARGET}x: "
        f"{'met' if max(shared) <= TARGET else 'NOT met'}. The separate energy forward costs "
        f"{ratios[('generate', 'otb + own forward')]:.3f}x. Ratios are of the process's CPU time per step "
        "(one torch thread); the wall times, shown for reference, include waiting for the other jobs on a "
        "shared machine (see the load average above) and vary far more."
    )
    description = (
        f"Qwen2, {params:.1f}M parameters (hidden 384, {layers} layers, character vocabulary of 52), "
        "random init, learning rate 0 (identical completions in every arm); 32 completions (4 prompts x 8) "
        "of up to 24 tokens per step; num_iterations=2 "
        f"(TRL computes old log-probs); {steps} steps per run, the first 2 discarded; {repeats} repeats, "
        "arms alternated; torch threads 1."
    )
    write_result(out, "OTB's cost per TRL step", "bench_trl_step.py", quick, 1, description, table, verdict)


if __name__ == "__main__":
    main()
