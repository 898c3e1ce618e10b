"""Run a training recipe: a YAML mapping of otbrl keys (task or dataset, model, reward, warm start) and
`OTBGRPOConfig` fields. A run writes checkpoints, TensorBoard logs, `metrics.jsonl` (one line per step,
with the cumulative number of generated tokens), `summary.md`, `summary.json` and `curves.png` under its
output_dir.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

RECIPES = Path(__file__).resolve().parent / "recipes"

# otbrl's own recipe keys and their defaults; every other key must be an OTBGRPOConfig field.
RECIPE_DEFAULTS: dict[str, Any] = {
    "task": None,  # a built-in task (otbrl.tasks.TASKS) ...
    "dataset": None,  # ... or a JSONL file / datasets.save_to_disk directory with prompt and answer columns
    "prompt_column": "prompt",
    "answer_column": "answer",
    "model": "warm:small",  # warm:<preset> (cached supervised warm start), random:<preset>, or a model dir
    "reward": "task",  # task (the built-in task's exact reward), exact, numeric or math
    "train_size": 4096,  # prompts drawn for a built-in task
    "eval_size": 128,  # held-out prompts scored before and after training
    "warm_start_target": 0.3,
    "warm_start_seed": 0,  # the warm start's own seed: runs with different `seed`s start from one model
    "warm_start_seconds": 600.0,
    "tools": None,  # tool names for multi-turn rollouts (otbrl.rollout), e.g. [calc]; None: the task's
    "max_turns": None,  # tool calls per completion; None: the task's (3 without a task)
    "threads": None,  # torch threads; None keeps torch's default
    "plot": True,
}

# What a CPU run needs that TRL's defaults get wrong (bf16 and gradient checkpointing are on by default).
TRAINER_DEFAULTS: dict[str, Any] = {
    "output_dir": "runs/otbrl",
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "report_to": ["tensorboard"],
    "save_strategy": "steps",
    "save_steps": 50,
    "beta": 0.0,
    "seed": 0,
}


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def parse_value(text: str) -> Any:
    """A command-line override value: YAML (numbers, booleans, lists, JSON-style mappings), with
    exponent numbers like 1e-4 that YAML 1.1 leaves as strings read as floats."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def load_recipe(config: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a recipe file (or a packaged recipe by name), apply overrides, check every key."""
    from otbrl.integrations.trl import OTBGRPOConfig

    path = Path(config)
    if not path.is_file():
        path = RECIPES / f"{config}.yaml"
        if not path.is_file():
            known = ", ".join(recipe_names())
            raise ValueError(f"config: no file {config!r} and no packaged recipe of that name ({known})")
    recipe = yaml.safe_load(path.read_text()) or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"config: {path} must hold a mapping of keys to values")
    recipe.update(overrides or {})
    known = set(RECIPE_DEFAULTS) | {f.name for f in dataclasses.fields(OTBGRPOConfig)}
    for key in recipe:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"{key}: not a recipe key (otbrl keys: {', '.join(RECIPE_DEFAULTS)}; "
                f"or any OTBGRPOConfig field){hint}"
            )
    return {**RECIPE_DEFAULTS, **TRAINER_DEFAULTS, **recipe}


def load_rows(recipe: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows), each {"prompt", "answer"}; columns are checked before any training."""
    from otbrl.tasks import dataset

    if recipe["task"] and recipe["dataset"]:
        raise ValueError("dataset: give either task or dataset, not both")
    if recipe["task"]:
        seed = recipe["seed"]
        return dataset(recipe["task"], recipe["train_size"], seed), dataset(
            recipe["task"], recipe["eval_size"], seed + 1
        )
    if not recipe["dataset"]:
        raise ValueError("task: a recipe needs a built-in task or a dataset")
    import datasets

    source = Path(recipe["dataset"])
    if source.is_dir():
        data = datasets.load_from_disk(str(source))
    elif source.is_file():
        data = datasets.load_dataset("json", data_files=str(source), split="train")
    else:
        raise ValueError(f"dataset: {source} is neither a JSONL file nor a saved dataset directory")
    if isinstance(data, datasets.DatasetDict):
        data = data["train"]
    columns = {"prompt": recipe["prompt_column"], "answer": recipe["answer_column"]}
    missing = [c for c in columns.values() if c not in data.column_names]
    if missing:
        have = ", ".join(data.column_names)
        raise ValueError(
            f"dataset: rows lack column {missing[0]!r} (columns: {have}); set prompt_column / answer_column"
        )
    rows = [{"prompt": str(r[columns["prompt"]]), "answer": str(r[columns["answer"]])} for r in data]
    if len(rows) < 2:
        raise ValueError("dataset: needs at least 2 rows")
    cut = max(1, min(recipe["eval_size"], len(rows) // 10))
    return rows[cut:], rows[:cut]


def load_model(recipe: dict[str, Any], log: Callable[[str], Any]) -> tuple[Any, Any]:
    spec = str(recipe["model"])
    kind, _, preset = spec.partition(":")
    if kind == "warm":
        from otbrl.tasks import warm_start

        if not recipe["task"]:
            raise ValueError(
                "model: warm:<preset> warm-starts on a built-in task; set task, or give a model dir"
            )
        model, tokenizer, _ = warm_start(
            recipe["task"],
            preset or "small",
            target_reward=recipe["warm_start_target"],
            max_seconds=recipe["warm_start_seconds"],
            seed=recipe["warm_start_seed"],
            log=log,
        )
        return model, tokenizer
    if kind == "random":
        from otbrl.tasks import char_tokenizer, tiny_model

        return tiny_model(preset or "small", seed=recipe["seed"]), char_tokenizer()
    if Path(spec).is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(spec, local_files_only=True), tokenizer
    raise ValueError(f"model: {spec!r} is not warm:<preset>, random:<preset> or a local model directory")


def make_reward(recipe: dict[str, Any]) -> Callable[..., list[float]]:
    if recipe["reward"] == "task":
        from otbrl.tasks import get_task

        if not recipe["task"]:
            raise ValueError("reward: 'task' needs a built-in task; use exact, numeric or math for a dataset")
        task = get_task(recipe["task"])

        def task_reward(
            prompts: list[str], completions: list[str], answer: list[str], **_: Any
        ) -> list[float]:
            return [task.reward(c, a) for c, a in zip(completions, answer, strict=True)]

        task_reward.__name__ = f"{task.name}_reward"
        return task_reward
    from otbrl.app.rewards import get_reward

    return get_reward(recipe["reward"])


def tool_settings(recipe: dict[str, Any]) -> tuple[tuple[str, ...], int]:
    """(tool names, max turns) of a recipe: its own keys, else its built-in task's; () means one turn."""
    task = None
    if recipe["task"]:
        from otbrl.tasks import get_task

        task = get_task(recipe["task"])
    tools = recipe["tools"] if recipe["tools"] is not None else (task.tools if task else ())
    if isinstance(tools, str):
        tools = [tools]
    turns = recipe["max_turns"] if recipe["max_turns"] is not None else (task.max_turns if task else 3)
    if tools:
        from otbrl.rollout.multiturn import resolve_tools

        resolve_tools(list(tools))  # unknown names fail here
        if int(turns) < 1:
            raise ValueError(f"max_turns: must be >= 1 when tools are given, got {turns}")
    return tuple(tools), int(turns)


def _metrics_callback(path: Path, tokens_per_step: int) -> Any:
    from transformers import TrainerCallback

    class MetricsJsonl(TrainerCallback):
        """One JSON line per logged step, plus the cumulative count of generated tokens."""

        generated = 0.0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            # On resume keep the lines up to the checkpoint's step and continue its token count.
            if path.is_file():
                kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                kept = [r for r in kept if r.get("step", 0) <= state.global_step]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
                self.generated = kept[-1].get("generated_tokens", 0.0) if kept else 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            logs = dict(logs or {})
            if "completions/mean_length" in logs:
                self.generated += logs["completions/mean_length"] * tokens_per_step
            if "loss" in logs or "reward" in logs:
                with path.open("a") as f:
                    f.write(
                        json.dumps({"step": state.global_step, "generated_tokens": self.generated, **logs})
                        + "\n"
                    )

    return MetricsJsonl()


def run(recipe: dict[str, Any], resume: bool = False, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train as the recipe says. Returns the summary (also written to output_dir/summary.md)."""
    from datasets import Dataset

    from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer

    if recipe["threads"]:
        torch.set_num_threads(int(recipe["threads"]))
    torch.manual_seed(recipe["seed"])
    # Everything that can be wrong with the recipe fails here, before a warm start or a model load.
    train_rows, eval_rows = load_rows(recipe)
    reward = make_reward(recipe)
    tools, max_turns = tool_settings(recipe)
    fields = {f.name for f in dataclasses.fields(OTBGRPOConfig)}
    config = OTBGRPOConfig(
        **{k: v for k, v in recipe.items() if k in fields}, use_cpu=not torch.cuda.is_available()
    )
    model, tokenizer = load_model(recipe, log)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    from otbrl.rollout import evaluate

    def score(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return reward(prompts=prompts, completions=completions, answer=answers)

    evaluate_now = lambda: evaluate(  # noqa: E731
        model, tokenizer, eval_rows, score, config.max_completion_length, config.temperature, recipe["seed"],
        tools, max_turns,
    )  # fmt: skip
    before = evaluate_now()
    log(f"held-out reward before training: {before:.3f} ({len(eval_rows)} prompts)")
    trainer = OTBGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(train_rows),
        processing_class=tokenizer,
        **({"rollout_func": _tool_rollouts(tools, max_turns)} if tools else {}),
    )
    trainer.add_callback(_metrics_callback(out / "metrics.jsonl", config.generation_batch_size))
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=bool(resume) or None)
    seconds = time.perf_counter() - start
    trainer.save_model(str(out / "final"))
    after = evaluate_now()
    summary = summarise(out / "metrics.jsonl", config, before, after, seconds)
    (out / "summary.md").write_text(summary_table(summary) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if recipe["plot"]:
        plot_curves(
            out / "metrics.jsonl",
            out / "curves.png",
            title=f"{config.advantage_estimator}, N={config.num_generations}",
        )
    return summary


def _tool_rollouts(tools: tuple[str, ...], max_turns: int) -> Callable:
    import os

    from otbrl.integrations.trl import rollout_func

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that rollout_func is experimental
    return rollout_func(list(tools), max_turns)


def summarise(metrics: Path, config: Any, before: float, after: float, seconds: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    norms = [r["grad_norm"] for r in rows if "grad_norm" in r]
    k = max(1, len(rewards) // 10)
    return {
        "estimator": config.advantage_estimator,
        "group size N": config.num_generations,
        "steps": rows[-1]["step"] if rows else 0,
        "train seconds": round(seconds, 1),
        "generated tokens": int(rows[-1]["generated_tokens"]) if rows else 0,
        "held-out reward before": round(before, 3),
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


def plot_curves(metrics: Path, png: Path, title: str = "") -> None:
    """Reward and gradient norm against generated tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    tokens = [r["generated_tokens"] for r in rows if "reward" in r]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(tokens, [r["reward"] for r in rows if "reward" in r], lw=1, alpha=0.4, label="per step")
    smooth = _moving_average([r["reward"] for r in rows if "reward" in r], 10)
    top.plot(tokens[: len(smooth)], smooth, lw=2, label="moving average (10 steps)")
    top.set_ylabel("train reward")
    top.legend(loc="lower right")
    top.set_title(title)
    bottom.plot(
        [r["generated_tokens"] for r in rows if "grad_norm" in r],
        [r["grad_norm"] for r in rows if "grad_norm" in r],
        lw=1,
    )
    surges = [r["generated_tokens"] for r in rows if r.get("otb/grad_norm_surge")]
    for x in surges:
        bottom.axvline(x, color="red", alpha=0.3)
    bottom.set_ylabel("gradient norm" + (" (red: surge)" if surges else ""))
    bottom.set_xlabel("generated tokens")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _moving_average(values: list[float], k: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out
