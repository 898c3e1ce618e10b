"""Run a training recipe (`otbrl.app.recipe`) as a TRL run: model and prompts from `otbrl.app.sources`,
rewards under guard, OTB through `otbrl.integrations.trl`. A run writes checkpoints, TensorBoard logs,
`metrics.jsonl` (one line per step, with the cumulative number of generated tokens and train seconds),
`summary.md`, `summary.json` and `curves.png` under its output_dir, and resumes from its newest complete
checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from otbrl.app.answers import completion_text, get_reward
from otbrl.app.callbacks import PromptLedger, TokenBudgets, metrics_callback, progress_callback
from otbrl.app.checkpoints import resume_checkpoint
from otbrl.app.gpu_memory import apply_share, peak_gib
from otbrl.app.heldout_cache import EVAL_BEFORE_FILE, before_key, cache_folder, cached_score
from otbrl.app.metrics import read_metrics
from otbrl.app.plots import plot_curves
from otbrl.app.precision import resolve_bf16
from otbrl.app.recipe import episode_of, make_config, tool_settings
from otbrl.app.sft import with_sft
from otbrl.app.sources import (
    check_enough_rows,
    choose_model,
    load_model,
    load_rows,
    load_tokenizer,
    shape_prompts,
)
from otbrl.integrations.trl import OTBGRPOTrainer, rollout_func, sampler_rollout_func
from otbrl.integrations.trl.rewards import GuardedReward
from otbrl.rollout import evaluate
from otbrl.rollout.multiturn import Episode
from otbrl.tasks import get_task


def make_reward(recipe: dict[str, Any]) -> Callable[..., list[float]]:
    if recipe["reward"] == "task":  # a checked recipe has a task then
        task = get_task(recipe["task"])

        def task_reward(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
            return [task.reward(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]

        task_reward.__name__ = f"{task.name}_reward"
        return task_reward
    return get_reward(recipe["reward"])


def reward_failures(metrics: Path) -> int:
    """Reward-function failures over a whole run: otb/reward_failures is a running count that restarts
    at 0 in each process (a resumed run)."""
    total, last = 0.0, 0.0
    rows = read_metrics(metrics, "otb/reward_failures") if metrics.is_file() else []
    for value in (r["otb/reward_failures"] for r in rows):
        if value is not None:
            total += value - last if value >= last else value
            last = value
    return int(total)


def run(recipe: dict[str, Any], resume: bool = False, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train as the recipe says: `recipe` as `load_recipe` returns it (typed and checked; no rule is
    checked twice). Returns the summary (also written to output_dir/summary.md)."""
    if recipe["threads"]:
        torch.set_num_threads(int(recipe["threads"]))
    torch.manual_seed(recipe["seed"])
    apply_share(log)  # before anything reaches the GPU
    config = make_config(recipe)  # load_recipe checked every rule; the data's own rules fail next
    why = resolve_bf16(recipe.get("bf16"), config.use_cpu)[1]
    log(why or f"precision: {'bf16 autocast' if config.bf16 else 'float32'}")
    train_rows, eval_rows = load_rows(recipe)
    check_enough_rows(train_rows, config, "train_size" if recipe["task"] else "dataset")
    ledger = PromptLedger(make_reward(recipe))  # inside the guard: the guard counts the failures
    reward = GuardedReward(ledger, max_failure_fraction=recipe["reward_max_failure_fraction"])
    tools, max_turns = tool_settings(recipe)
    episode = episode_of(recipe)  # a task whose tools hold an environment's state: one box per completion
    recipe = with_sft(choose_model(recipe, log), log)  # a chat model's supervised warm start, if asked
    synthetic = str(recipe["model"]).partition(":")[0] in ("warm", "random")
    tokenizer = None if synthetic else load_tokenizer(recipe)
    if tokenizer is not None:
        train_rows, eval_rows, chat = shape_prompts(recipe, tokenizer, train_rows, eval_rows, config)
        log(f"prompts: {'chat messages (the tokenizer chat template)' if chat else 'plain text'}")
    out = Path(config.output_dir)
    checkpoint = resume_checkpoint(out, log) if resume and out.is_dir() else None
    if resume and checkpoint is None:
        log(f"no complete checkpoint in {out}: training from the start")
    model, tokenizer = load_model(recipe, log, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    # Its own guard: held-out failures are reported (and can stop the run) without counting as training's.
    fraction = recipe["reward_max_failure_fraction"]
    eval_reward = GuardedReward(make_reward(recipe), max_failure_fraction=fraction)

    def score(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return eval_reward(prompts=prompts, completions=completions, answer=answers)

    def evaluate_now() -> float:
        with autocast(config):  # sampled in the precision training samples in
            return evaluate(
                model,
                tokenizer,
                eval_rows,
                score,
                config.max_completion_length,
                config.temperature,
                recipe["seed"],
                tools,
                max_turns,
                progress=not config.disable_tqdm,
                samples=recipe["eval_samples"],
                batch_size=recipe["eval_batch_size"],
                compact=recipe["compact_decoding"],
                episode=episode,
                turn_cache=recipe["turn_cache"],
            )

    trainer = OTBGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(train_rows),
        processing_class=tokenizer,
        **_rollouts(
            episode or tools, max_turns, recipe["sampler"], recipe["compact_decoding"], recipe["turn_cache"]
        ),
    )
    # After the trainer is built: it has put the model where training samples (the GPU, say), so the
    # step-0 score is sampled there, in training's precision, like the scores at the token budgets.
    before, reused = None, False
    if recipe["eval_before"]:
        settings = {
            "max_new_tokens": config.max_completion_length,
            "temperature": config.temperature,
            "seed": recipe["seed"],
            "tools": list(tools),
            "max_turns": max_turns,
            "bf16": bool(config.bf16),
            "fp16": bool(config.fp16),
            "reward": recipe["reward"],
            "task": recipe["task"],
            # only when it changes the score: earlier one-sample keys stay valid
            **({"samples": recipe["eval_samples"]} if recipe["eval_samples"] > 1 else {}),
            **({"batch_size": recipe["eval_batch_size"]} if recipe["eval_batch_size"] else {}),
            **({"compact": True} if recipe["compact_decoding"] else {}),
            **({"turn_cache": True} if recipe["turn_cache"] and max_turns > 0 else {}),
        }
        log(f"held-out evaluation before training: {len(eval_rows)} prompts x {recipe['eval_samples']} each")
        folder = cache_folder()
        key = before_key(model, tokenizer, eval_rows, settings) if folder is not None else ""
        before, reused = cached_score(folder, key, evaluate_now, seed=recipe["seed"])
    if before is not None:
        same = ", reused: an earlier run's with the same model, prompts and seed" if reused else ""
        log(f"held-out reward before training: {before:.3f} ({len(eval_rows)} prompts{same})")
    if recipe["eval_before_only"]:  # the step-0 score alone, by the path a training run takes to it
        # not summary.json: that file says a run finished training (otbrl compare, studies read it so)
        summary = {"held-out reward before": before, "reused": reused, "eval_before_only": True}
        (out / EVAL_BEFORE_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        return summary
    metrics = out / "metrics.jsonl"
    budgets = TokenBudgets(evaluate_now, list(recipe["eval_at_tokens"] or []), recipe["max_generated_tokens"])
    trainer.add_callback(metrics_callback(metrics, config.generation_batch_size, budgets, ledger))
    for printer in (ProgressCallback, PrinterCallback):  # they print every step's dict of ~30 metrics
        trainer.remove_callback(printer)
    trainer.add_callback(
        progress_callback(config.generation_batch_size, not config.disable_tqdm, budgets.stop_at, metrics)
    )
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    if not metrics.is_file():
        raise ValueError(f"max_steps: no training step ran (max_steps {config.max_steps})")
    trainer.save_model(str(out / "final"))
    rows = read_metrics(metrics)
    # A held-out evaluation at the last step (a token budget) is the final one: no second pass.
    after = rows[-1]["heldout_reward"] if rows and "heldout_reward" in rows[-1] else evaluate_now()
    seconds = rows[-1].get("train_seconds", 0.0) if rows else 0.0  # the whole run, resumed parts too
    summary = summarise(metrics, config, before, after, seconds)
    summary["reward failures"] = reward_failures(metrics)
    if (peak := peak_gib()) is not None:
        summary["peak GPU memory (GiB)"] = peak
    (out / "summary.md").write_text(summary_table(summary) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if recipe["plot"]:
        plot_curves(
            metrics, out / "curves.png", f"{config.advantage_estimator}, N={config.num_generations}", before
        )
    return summary


def autocast(config: Any) -> Any:
    """The autocast that TRL's accelerator puts the training forward under (bf16 or fp16), for sampling
    done outside the trainer."""
    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
    device = "cuda" if torch.cuda.is_available() and not config.use_cpu else "cpu"
    return torch.autocast(device, dtype=dtype, enabled=dtype is not None)


def written(out: Path) -> list[str]:
    """What a run left in its output_dir, for the closing message."""
    names = [
        n
        for n in (
            "summary.md",
            "summary.json",
            EVAL_BEFORE_FILE,
            "metrics.jsonl",
            "curves.png",
            "recipe.yaml",
        )
        if (out / n).is_file()
    ]
    if next(out.rglob("events.out.tfevents*"), None) is not None:
        names.append("TensorBoard logs")
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*") if p.is_dir())
    if checkpoints:
        names.append(f"checkpoints ({', '.join(checkpoints)})")
    if (out / "final").is_dir():
        names.append("final (the trained model)")
    return names


def _rollouts(
    tools: tuple[str, ...] | Episode,
    max_turns: int,
    sampler: str,
    compact: bool = False,
    turn_cache: bool = False,
) -> dict[str, Callable]:
    """OTBGRPOTrainer's `rollout_func` keyword: otbrl's sampler, with tools (names, or an episode: each
    completion's own toolbox; `turn_cache`: each row's KV cache lives from turn to turn) or one turn
    (`compact`: ended rows leave the KV cache); none when TRL generates."""
    if not tools and sampler == "trl":
        return {}
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that rollout_func is experimental
    if callable(tools):
        return {"rollout_func": rollout_func(tools, max_turns, compact=compact, turn_cache=turn_cache)}
    if tools:
        return {"rollout_func": rollout_func(list(tools), max_turns, compact=compact, turn_cache=turn_cache)}
    return {"rollout_func": sampler_rollout_func(compact)}


def summarise(
    metrics: Path, config: Any, before: float | None, after: float, seconds: float
) -> dict[str, Any]:
    rows = read_metrics(metrics)
    rewards = [r["reward"] for r in rows if "reward" in r]
    norms = [r["grad_norm"] for r in rows if "grad_norm" in r]
    k = max(1, len(rewards) // 10)
    return {
        "estimator": config.advantage_estimator,
        "group size N": config.num_generations,
        "steps": rows[-1]["step"] if rows else 0,
        "train seconds": round(seconds, 1),
        "generated tokens": int(rows[-1]["generated_tokens"]) if rows else 0,
        "held-out reward before": None if before is None else round(before, 3),
        "held-out reward after": round(after, 3),
        "train reward, first 10% of steps": round(sum(rewards[:k]) / k, 3) if rewards else None,
        "train reward, last 10% of steps": round(sum(rewards[-k:]) / k, 3) if rewards else None,
        "median grad norm": round(sorted(norms)[len(norms) // 2], 4) if norms else None,
        "grad-norm surges": int(sum(r.get("otb/grad_norm_surge", 0) for r in rows)),
        "lr decay triggers": int(sum(r.get("otb/lr_decay_trigger", 0) for r in rows)),
    }


def summary_table(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    lines = [f"| {'':{width}} | value |", f"|{'-' * (width + 2)}|------:|"]
    lines += [f"| {k:{width}} | {v} |" for k, v in summary.items()]
    return "\n".join(lines)
