"""Multi-turn rollouts with and without a KV cache kept from turn to turn (`turn_cache`).

Issue 34, item 5 (speed per run): on chat_draws_told every tool call pauses a row, and each new turn read
the row's whole context again (the ~70-token chat prompt, its draws, the tool's outputs): on 64 rows a
turn's prefill fed 27,568 positions for 3,196 completion tokens. With `turn_cache` a turn feeds only each
row's last token and the tool's output. This measures both on the same prompts, episodes and seed,
alternating, with the positions each forward was fed, and how many rows draw the same tokens (the cached
attention sums in another order, so logits may differ in their last bits). Then a few RL steps of
`otbrl train` (OTB, N=4, 4 prompts x 4 answers, learning rate 1e-5, seed 0) from the same warm start with
and without it, and what a run of the smollm2c protocol costs either way (its budget of generated tokens
and its 1,024-sample evaluations).

The model is the warm start that issue 34's task pilot picked (pilot 9: `otbrl sft` of SmolLM2-135M-
Instruct, 10 steps of chat_draws_told's training side; built on first use in $OTBRL_CACHE/sft/); 16
distinct held-out problems x 4 samples (quick: 2 x 4), each sample with its own seeded episode, T=1,
compact decoding, float32, the torch threads of the machine (`OMP_NUM_THREADS`).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_turn_cache.py   # docs/results/turn-cache.md
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from common import command_line, markdown_table, write_result

from otbrl.app.precision import cpu_flags
from otbrl.app.recipe import load_recipe
from otbrl.app.sft import with_sft
from otbrl.app.sources import as_chat, choose_model, load_model
from otbrl.integrations.trl.rollout import prompt_ids
from otbrl.rollout.multiturn import episode_seed, episode_toolboxes, sample_with_tools
from otbrl.tasks import get_task
from studies.llm_pilot2 import distinct_problems

TASK = "chat_draws_told"
BUDGET, EVAL_SAMPLES, ARMS = 24_000, 1024, 3  # smollm2c: tokens a run, samples an evaluation, arms a seed
SFT = {"sft_steps": 10, "sft_learning_rate": 2e-5, "sft_batch_size": 8, "sft_seed": 0}  # pilot 9's pick


def fed_positions(model: torch.nn.Module) -> Counter:
    """Count the positions forwards are fed: `prefill` (a turn's first forward), `decode` (one a row)."""
    seen: Counter = Counter()

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen["prefill" if ids.shape[1] > 1 else "decode"] += ids.numel()
        seen["forwards"] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def train_steps(recipe: dict, steps: int, cached: bool, folder: Path) -> dict[str, float]:
    """`steps` RL steps of `otbrl train` from the warm start: training seconds (the held-out evaluation
    excluded), steps and generated tokens, from its metrics."""
    from otbrl.app.recipe import load_recipe
    from otbrl.app.train import run

    overrides = {
        "task": TASK,
        "model": recipe["model"],
        "model_fallback": None,
        "max_steps": steps,
        "eval_before": False,
        "eval_size": 2,
        "save_strategy": "no",
        "report_to": [],
        "plot": False,
        "disable_tqdm": True,
        "threads": torch.get_num_threads(),
        "compact_decoding": True,
        "turn_cache": cached,
        "output_dir": str(folder / f"turn_cache_{cached}"),
    }
    run(load_recipe("smollm2-draws", overrides), log=lambda _: None)
    lines = (folder / f"turn_cache_{cached}" / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(line) for line in lines][-1]
    return {"seconds": last["train_seconds"], "steps": last["step"], "tokens": last["generated_tokens"]}


def main() -> None:
    quick, out, threads = command_line(__doc__.splitlines()[0], "2 problems x 4", "turn-cache.md")
    recipe = with_sft(choose_model(load_recipe("smollm2-draws", {"task": TASK, **SFT}), print), print)
    model, tok = load_model(recipe, print)
    model.eval()
    task = get_task(TASK)
    problems = 2 if quick else 16
    rows = [r for r in distinct_problems(TASK, problems, 0, heldout=True) for _ in range(4)]
    ids = [prompt_ids(tok, as_chat(p, None)) for p, _, _ in rows]
    seeds = [episode_seed("bench-turn-cache", i) for i in range(len(rows))]
    fed = fed_positions(model)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    counts: dict[bool, Counter] = {}
    results = {}
    for cached in (False, True, False, True):
        boxes = episode_toolboxes(task.episode, seeds, [p for p, _, _ in rows])  # fresh decks each run
        gen = torch.Generator().manual_seed(0)
        fed.clear()
        start = time.perf_counter()
        with torch.no_grad():
            results[cached] = sample_with_tools(
                model, tok, ids, boxes, task.max_completion_tokens, task.max_turns, 1.0, gen,
                compact=True, turn_cache=cached,
            )  # fmt: skip
        seconds[cached].append(time.perf_counter() - start)
        counts[cached] = Counter(fed)
        print(f"turn_cache={cached}: {seconds[cached][-1]:.1f} s", flush=True)
    steps = 1 if quick else 4
    trained: dict[bool, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for cached in (False, True):
            trained[cached] = train_steps(recipe, steps, cached, Path(folder))
            print(f"training, turn_cache={cached}: {trained[cached]}", flush=True)
    ref, fast = results[False], results[True]
    alike = [i for i, a in enumerate(ref.completion_ids) if a == fast.completion_ids[i]]
    same = len(alike)  # log-probs compared on those rows (another row's tokens part ways)
    diff = max(abs(a - b) for i in alike for a, b in zip(ref.logprobs[i], fast.logprobs[i], strict=True))
    tokens = {c: sum(map(len, results[c].completion_ids)) for c in (False, True)}
    own = {c: sum(map(sum, results[c].model_mask)) for c in (False, True)}
    table = markdown_table(
        ["turns", "seconds (two runs)", "prefill positions fed", "forwards", "model tokens", "s per sample"],
        [
            [
                "KV cache kept from turn to turn" if c else "each turn reads the whole context",
                " / ".join(f"{s:.1f}" for s in seconds[c]),
                f"{counts[c]['prefill']:,}",
                f"{counts[c]['forwards']:,}",
                f"{own[c]:,}",
                f"{min(seconds[c]) / len(rows):.2f}",
            ]
            for c in (False, True)
        ],
    )
    calls, flags = sum(ref.calls) / len(rows), cpu_flags()
    cost = {}
    for c in (False, True):
        t = trained[c]
        train = BUDGET / (t["tokens"] / t["steps"]) * t["seconds"] / t["steps"]
        evaluate = EVAL_SAMPLES * min(seconds[c]) / len(rows)
        cost[c] = (train, evaluate, train + evaluate * (1 + 1 / ARMS))  # step 0 is shared by the arms
    runs = markdown_table(
        [
            "turns",
            "RL s/step",
            "tokens/step",
            "train min/run",
            "eval min (1,024)",
            "min/run",
            "runs/hour, 2 cores",
        ],
        [
            [
                "KV cache kept from turn to turn" if c else "each turn reads the whole context",
                f"{trained[c]['seconds'] / trained[c]['steps']:.1f}",
                f"{trained[c]['tokens'] / trained[c]['steps']:.0f}",
                f"{cost[c][0] / 60:.1f}",
                f"{cost[c][1] / 60:.1f}",
                f"{cost[c][2] / 60:.1f}",
                f"{2 * 3600 / cost[c][2]:.2f}",
            ]
            for c in (False, True)
        ],
    )
    verdict = (
        f"Speed-up (best of two each): {min(seconds[False]) / min(seconds[True]):.2f}x. Rows with identical "
        f"tokens: {same} of {len(rows)}; largest log-prob difference {diff:.1e}. Tool calls per sample "
        f"{calls:.2f}; completion tokens with tool output {tokens[False]:,} (model's own {own[False]:,}). "
        f"CPU flags: avx512_bf16 {'avx512_bf16' in flags}, amx_bf16 {'amx_bf16' in flags} (float32 here).\n\n"
        f"## What a run of smollm2c costs\n\n{steps} RL steps each way from the warm start (the same seed: "
        "the steps sample other tokens once a row differs, so their lengths differ a little). A run is "
        f"{BUDGET:,} generated tokens at the measured tokens per step, one 1,024-sample evaluation at its "
        "end at the measured seconds per sample, and a third of the seed's shared step-0 evaluation; runs "
        "per hour assume two one-thread runs side by side, one a core.\n\n" + runs
    )
    write_result(
        out,
        "Multi-turn rollouts with a KV cache kept from turn to turn (SmolLM2, chat_draws_told, issue 34)",
        Path(__file__).name,
        quick,
        threads,
        f"{problems} held-out problems x 4 samples, each with its own episode, T=1, compact decoding, at "
        f"most {task.max_completion_tokens} completion tokens and {task.max_turns} calls, float32; model "
        f"{recipe['model']} (pilot 9's warm start: chat_draws_told after 10 sft steps).",
        table,
        verdict,
        env="OMP_NUM_THREADS=1 ",
    )


if __name__ == "__main__":
    main()
