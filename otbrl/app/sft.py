"""`otbrl sft`: a supervised warm start of a chat model on a sum task's training side, before RL.

SmolLM2-135M-Instruct (the only real model this project installs from the package registry, as a 4-bit
GGUF) solves almost none of the sum problems untrained: 3-9% in four pilots (docs/results/llm-pilot*.md).
A short fine-tune on worked solutions (`otbrl.tasks.worked`: three styles of different length, drawn
per example) teaches the answer's form, and its length sets where RL starts. It draws its problems from
the task's training side only (`dataset(split="train")`), so the held-out problems of every later run stay
unseen by every stage.

TRL's SFTTrainer does the training: conversational prompt-completion rows, loss on the completion only,
the recipe's chat template and system prompt, float32 (`bf16` as the recipe says). The result is a plain
model folder that `otbrl train --model FOLDER` starts from, with `sft-summary.json` beside it.

    otbrl sft --config smollm2-addlist --steps 60 --output-dir runs/sft/addlist-60
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otbrl import __version__ as otbrl_version
from otbrl.app.precision import resolve_bf16
from otbrl.app.recipe import load_recipe
from otbrl.app.sources import as_chat, choose_model, load_model, template_hint
from otbrl.tasks import dataset, get_task
from otbrl.tasks.chat_problems import PROBLEM_TASKS
from otbrl.tasks.worked import STYLES, WEIGHTS


def sft_rows(task: str, n: int, seed: int, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """`n` conversational prompt-completion rows of `task`'s training side, each completion the task's
    demonstration (`Task.demonstrate`: for the chat sum tasks a worked solution, its style drawn from a
    generator seeded by task and seed). A demonstration with tool output (a multi-turn task) keeps its
    parts, `parts: [[text, trained], ...]`, so that the tool's output is not trained on (`tokenized_rows`).
    A task with no demonstration for a chat model is refused."""
    spec = get_task(task)
    if spec.demonstrate is None or spec.vocabulary != "text":
        worked = [t for t in PROBLEM_TASKS if PROBLEM_TASKS[t].demonstrate is not None]
        raise ValueError(f"sft: task {task!r} has no worked solutions for a chat model; one of {worked}")
    rng = random.Random(f"sft:{task}:{seed}")
    rows = []
    for r in dataset(spec, n, seed=seed, split="train"):
        parts = spec.demonstrate(r["prompt"], r["answer"], rng)
        solution = "".join(text for text, _ in parts)
        row = {
            "prompt": as_chat(r["prompt"], system_prompt),
            "completion": [{"role": "assistant", "content": solution}],
        }
        if not all(trained for _, trained in parts):
            row["parts"] = [[text, bool(trained)] for text, trained in parts]
        rows.append(row)
    return rows


def tokenized_rows(rows: list[dict[str, Any]], tokenizer: Any, **template: Any) -> list[dict[str, list[int]]]:
    """Rows with `parts` as TRL's processed form: `input_ids` (the prompt through the chat template, then
    each part tokenized on its own, as a multi-turn rollout puts model text and tool output together, then
    the end-of-turn token) and `completion_mask` (1 on the model's text and the end of turn, 0 on the
    prompt and the tool's output), so the loss never trains the model to write a tool's output."""
    from otbrl.integrations.trl.rollout import prompt_ids

    out = []
    for r in rows:
        ids = prompt_ids(tokenizer, r["prompt"], **template)
        mask = [0] * len(ids)
        for text, trained in r["parts"]:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(trained)] * len(piece)
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
        out.append({"input_ids": ids, "completion_mask": mask})
    return out


def style_of(text: str) -> str:
    """Which of `STYLES` a worked solution reads as (for the summary's counts; with two terms, steps and
    whole are the same text and count as whole)."""
    if "=" not in text:
        return "brief"
    return "steps" if text.count("=") > 1 else "whole"


def warm_start_chat(
    recipe: dict[str, Any],
    steps: int,
    out: Path,
    *,
    learning_rate: float = 2e-5,
    batch_size: int = 8,
    seed: int = 0,
    log: Callable[[str], Any] = print,
) -> Path:
    """Fine-tune the recipe's model for `steps` steps of `batch_size` worked solutions of its task's
    training side; save it (with its tokenizer) to `out/final` and a summary to `out/sft-summary.json`.
    Returns `out/final`."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"sft: steps and batch_size must be at least 1, got {steps} and {batch_size}")
    task = recipe.get("task")
    if not task:
        raise ValueError("sft: the recipe names no task (a built-in sum task such as chat_addlist_work)")
    rows = sft_rows(task, steps * batch_size, seed, recipe.get("system_prompt"))  # refuses other tasks

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from otbrl.integrations.trl.config import checkpointing_key

    model, tokenizer = load_model(choose_model(recipe, log), log)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"sft: the tokenizer of {recipe['model']} has no chat template, and the warm start trains chat "
            f"turns: {template_hint()}"
        )
    longest = int(recipe.get("max_prompt_length") or 256) + int(recipe.get("max_completion_length") or 128)
    config = SFTConfig(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        completion_only_loss=True,
        max_length=longest,
        bf16=bool(resolve_bf16(recipe.get("bf16", False), not _cuda())[0]),
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        seed=seed,
        data_seed=seed,
        use_cpu=not _cuda(),
        disable_tqdm=False,
        **{checkpointing_key(): True},  # TRL's default for SFT, under the name transformers does not warn on
    )
    started = time.perf_counter()
    tools = any("parts" in r for r in rows)
    if tools:  # tool output inside: tokenized here, its tokens not trained
        data = Dataset.from_list(
            tokenized_rows(rows, tokenizer, **(recipe.get("chat_template_kwargs") or {}))
        )
    else:
        data = Dataset.from_list(rows)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    seconds = time.perf_counter() - started
    final = out / "final"
    trainer.model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {
        "task": task,
        "model": str(recipe["model"]),
        "steps": steps,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "seed": seed,
        "rows": len(rows),
        "split": "train",  # every row from the task's training side: no held-out problem is seen
        # the sum tasks' worked styles; a multi-turn task's demonstrations by their number of tool outputs
        "styles": None
        if tools
        else {s: Counter(style_of(r["completion"][0]["content"]) for r in rows)[s] for s in STYLES},
        "tool_outputs": dict(sorted(Counter(sum(not t for _, t in r["parts"]) for r in rows).items()))
        if tools
        else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "seconds": round(seconds, 1),
    }
    (out / "sft-summary.json").write_text(json.dumps(summary, indent=1))
    log(
        f"sft: {steps} steps x {batch_size} worked solutions of {task} (training side) in {seconds:.0f} s; "
        f"loss {summary['loss_first']} -> {summary['loss_last']}; model in {final}"
    )
    return final


def sft_key(recipe: dict[str, Any]) -> str:
    """The name of a recipe's warm start: a hash of `sft_key_parts`."""
    return hashlib.sha256(json.dumps(sft_key_parts(recipe), sort_keys=True).encode()).hexdigest()[:16]


def sft_key_parts(recipe: dict[str, Any]) -> dict[str, Any]:
    """What a recipe's warm start is a function of: the source model (a file's content where it is one),
    the task and system prompt, the `sft_*` settings, precision, library versions and the machine kind
    (float32 sums differ in their last bits between CPU kinds, and a run's step-0 score with them)."""
    import platform

    import torch
    import transformers
    import trl

    from otbrl.app.precision import cpu_flags
    from otbrl.app.sources import _digest, chat_template_text, gguf_file

    source = gguf_file(str(recipe["model"]))
    model = str(recipe["model"]) if source is None else f"gguf:{_digest(source)}"
    parts = {
        "model": model,
        "revision": recipe.get("model_revision"),
        "task": recipe["task"],
        "system_prompt": recipe.get("system_prompt"),
        "settings": [recipe[k] for k in ("sft_steps", "sft_learning_rate", "sft_batch_size", "sft_seed")],
        "bf16": bool(resolve_bf16(recipe.get("bf16", False), not _cuda())[0]),
        "lengths": [recipe.get("max_prompt_length"), recipe.get("max_completion_length")],
        "chat_template_kwargs": recipe.get("chat_template_kwargs"),
        "demonstrations": [STYLES, WEIGHTS],
        "versions": [torch.__version__, transformers.__version__, trl.__version__, otbrl_version],
        "machine": [platform.machine(), sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))],
        "cuda": _cuda(),
    }
    if recipe.get("chat_template_path"):  # only when given: the keys of warm starts built before stay
        text = chat_template_text(str(recipe["chat_template_path"]))
        parts["chat_template"] = hashlib.sha256(text.encode()).hexdigest()
    return parts


def with_sft(recipe: dict[str, Any], log: Callable[[str], Any] = print) -> dict[str, Any]:
    """The recipe with `model` set to its supervised warm start (`sft_steps` > 0), built on first use under
    `$OTBRL_CACHE/sft/<task>-<steps>-<key>` (one process builds it while the others wait on a lock) and
    reused after; a recipe without `sft_steps` is returned as it is."""
    if not recipe.get("sft_steps"):
        return recipe
    from filelock import FileLock

    from otbrl.app.sources import cache_dir

    where = cache_dir() / "sft" / f"{recipe['task']}-{recipe['sft_steps']}-{sft_key(recipe)}"
    where.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where) + ".lock"):
        if not (where / "sft-summary.json").is_file():  # written last: a killed build has none
            log(f"sft: building the warm start ({recipe['sft_steps']} steps) in {where}")
            shutil.rmtree(where, ignore_errors=True)  # a build killed half way starts again
            where.mkdir(parents=True)
            # what the folder's name hashes: when a later run builds again, a diff of two of these says why
            (where / "key.json").write_text(
                json.dumps(sft_key_parts(recipe), indent=1, sort_keys=True) + "\n"
            )
            warm_start_chat(
                recipe,
                int(recipe["sft_steps"]),
                where,
                learning_rate=float(recipe["sft_learning_rate"]),
                batch_size=int(recipe["sft_batch_size"]),
                seed=int(recipe["sft_seed"]),
                log=log,
            )
        else:
            log(f"sft: the warm start in {where} (built before: reused)")
    # sft_steps 0: the recipe.yaml a run writes then names the warm start itself, not a second one on it
    return {**recipe, "model": str(where / "final"), "model_fallback": None, "sft_steps": 0}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sft",
        help="supervised warm start of a chat recipe's model on worked solutions of its task's training side",
    )
    p.add_argument("--config", required=True, help="a packaged recipe name or a recipe YAML (model and task)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--output-dir", type=Path, required=True, help="where final/ and sft-summary.json go")
    p.add_argument("--learning-rate", type=float, default=2e-5, help="constant rate (default 2e-5)")
    p.add_argument("--batch-size", type=int, default=8, help="worked solutions per step (default 8)")
    p.add_argument("--seed", type=int, default=0, help="which training-side problems and styles (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the recipe's)")
    return p


def command(args: argparse.Namespace, rest: list[str]) -> None:
    import torch

    if rest:
        raise SystemExit(f"otbrl sft: unexpected arguments {rest}")
    try:
        recipe = load_recipe(args.config)
        threads = args.threads or recipe.get("threads")
        if threads:
            torch.set_num_threads(int(threads))
        warm_start_chat(
            recipe,
            args.steps,
            args.output_dir,
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
            seed=args.seed,
        )
    except ValueError as err:
        raise SystemExit(f"otbrl {err}" if str(err).startswith("sft:") else f"otbrl sft: {err}") from None
