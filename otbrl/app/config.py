"""The configuration of a recipe: otbrl's own keys (`RecipeKeys`, each documented below) and the
`OTBGRPOConfig` defaults a recipe changes for a CPU run (`TRAINER_DEFAULTS`). Every other recipe key is an
`OTBGRPOConfig` field, documented there and in TRL's `GRPOConfig`. `otbrl.app.recipe` reads and checks them.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from typing import Any


@dataclasses.dataclass
class RecipeKeys:
    r"""
    otbrl's own recipe keys. A recipe (a YAML file, or `--key value` after `otbrl train`) holds these and any
    field of `OTBGRPOConfig` (TRL's `GRPOConfig` plus the advantage estimator and the stability settings);
    nothing else is a recipe key.

    Parameters:
        > Prompts: a built-in task or a dataset

        task (`str` or `None`, *optional*, defaults to `None`):
            A built-in task (`otbrl.tasks.TASKS`: prompts, answers and an exact reward). Give either `task` or
            `dataset`.
        dataset (`str` or `None`, *optional*, defaults to `None`):
            A dataset with prompt and answer columns: a JSONL/JSON/CSV/Parquet file, a `datasets.save_to_disk`
            directory, or a Hugging Face Hub dataset name (`ORG/NAME`).
        dataset_config (`str` or `None`, *optional*, defaults to `None`):
            The Hub dataset's configuration (e.g. gsm8k's `"main"`).
        dataset_split (`str`, *optional*, defaults to `"train"`):
            The split prompts are read from.
        dataset_revision (`str` or `None`, *optional*, defaults to `None`):
            A Hub dataset's branch, tag or commit.
        prompt_column (`str`, *optional*, defaults to `"prompt"`):
            The dataset's column of prompts.
        answer_column (`str`, *optional*, defaults to `"answer"`):
            The dataset's column of reference answers, handed to the reward.
        chat (`bool` or `None`, *optional*, defaults to `None`):
            Chat prompts (lists of `{"role", "content"}` messages through the tokenizer's chat template).
            `None`: chat when the tokenizer has a chat template (instruct models), plain text otherwise.
        system_prompt (`str` or `None`, *optional*, defaults to `None`):
            The system message of chat prompts.
        chat_template_path (`str` or `None`, *optional*, defaults to `None`):
            A chat template for a tokenizer that has none (a base model, whose GGUF file often carries
            none) or in place of its own: a Jinja file (`.jinja` or `.j2`), or the name of one otbrl
            ships (`gemma`: Gemma's turns, `<start_of_turn>user` ... `<end_of_turn>`). Used by the
            prompts, the held-out evaluation and the warm start (`sft_steps`), and saved with a warm
            start's tokenizer. `None`: the tokenizer's own.
        train_size (`int`, *optional*, defaults to `4096`):
            Prompts drawn for a built-in task.

        > Model

        model (`str`, *optional*, defaults to `"warm:small"`):
            `warm:<preset>` (a cached supervised warm start), `random:<preset>`, a local model directory,
            a `.gguf` file or a folder holding one, `package:<package>/<file.gguf>` (a model in a wheel),
            or a Hub model id (`ORG/NAME`: downloaded on a connected machine, read from the cache under
            `HF_HUB_OFFLINE=1`).
        model_revision (`str` or `None`, *optional*, defaults to `None`):
            A Hub model's branch, tag or commit.
        model_fallback (`str` or `None`, *optional*, defaults to `None`):
            What loads instead when `model` is a Hub id that this machine can neither fetch nor find in its
            cache: a local directory, a `.gguf` file, or `package:<package>/<file.gguf>`.

        > Generation

        sampler (`str`, *optional*, defaults to `"trl"`):
            Who generates single-turn completions: `"trl"` (TRL's generate; OTB's energy then comes from a
            pass TRL makes anyway, or one extra forward) or `"otbrl"` (otbrl's KV-cache sampler through
            `rollout_func`: the energy comes from the sampling logits, no extra pass). Tool rollouts always
            use otbrl's.
        compact_decoding (`bool`, *optional*, defaults to `False`):
            otbrl's sampler (training rollouts with `sampler: otbrl` or tools, and the held-out
            evaluation) drops the rows that have ended, or paused at a tool call, from its KV cache and
            its forward: each row keeps
            its random draws, so the completions are the same up to the last bits of a smaller batch's
            logits (a token can then differ, rarely). About 2x faster when answers are much shorter than
            the longest (docs/results/compact-decode.md). Off by default: a registered experiment keeps
            the value it was registered with.
        turn_cache (`bool`, *optional*, defaults to `False`):
            Multi-turn rollouts (tools) keep each row's KV cache from one turn to the next, so a turn reads
            only the row's last token and the tool's output instead of its whole context again (in the
            training rollouts and the held-out evaluation). The logits are those of reading the context
            afresh up to float rounding, so a token can differ, rarely. Off by default: a registered
            experiment keeps the value it was registered with (docs/results/turn-cache.md).
        tools (`list[str]` or `None`, *optional*, defaults to `None`):
            Tool names for multi-turn rollouts (`otbrl.rollout`). `None`: the task's tools.
        max_turns (`int` or `None`, *optional*, defaults to `None`):
            Tool calls per completion. `None`: the task's (3 without a task).

        > Reward

        reward (`str`, *optional*, defaults to `"task"`):
            `task` (the built-in task's exact reward), `exact`, `numeric` or `math` (`otbrl.app.answers`).
        reward_max_failure_fraction (`float`, *optional*, defaults to `0.5`):
            The run stops when the reward function fails on every sample of a batch, or on more than this
            fraction of all samples scored so far.

        > Evaluation and budget

        eval_size (`int`, *optional*, defaults to `128`):
            Held-out prompts (never training prompts) scored before and after training.
        eval_distinct_problems (`bool`, *optional*, defaults to `False`):
            With a task, the held-out prompts pose `eval_size` distinct problems (each in one wording)
            instead of `eval_size` distinct prompts, some of which may pose one problem in two wordings:
            every prompt is then an independent unit of the evaluation. Changes which prompts are drawn,
            so a registered experiment keeps the value it was registered with.
        eval_samples (`int`, *optional*, defaults to `1`):
            Completions sampled and scored per held-out prompt: the score is their mean over all
            `eval_size` x `eval_samples` of them. More than one lowers the evaluation's own noise (its
            binomial SD) below the effects a comparison looks for.
        eval_batch_size (`int` or `None`, *optional*, defaults to `None`):
            Held-out completions decoded at a time (`None`: all at once). A bound on the evaluation's
            memory (its KV cache grows with the batch): set it when many runs share one GPU or a large
            evaluation does not fit. Chunks draw other samples than one batch would (same seed, same
            distribution), so a registered experiment keeps the value it was registered with.
        eval_at_tokens (`list[int]` or `None`, *optional*, defaults to `None`):
            Held-out evaluation also at these budgets of generated tokens (at the first step that reaches
            each), so that arms with different group sizes are compared at equal cost.
        eval_before (`bool`, *optional*, defaults to `True`):
            Held-out evaluation before training (the same for every arm of a seed in a study: skip it there).
        eval_before_only (`bool`, *optional*, defaults to `False`):
            Compute the held-out score before training (`eval_before`), write it to eval-before.json and
            stop: no training (and no summary.json, which says a run finished). With
            `OTBRL_HELDOUT_CACHE` set, the score is kept there under its key for the runs that share it
            (a study computes a seed's step-0 score ahead of its runs this way).
        max_generated_tokens (`int` or `None`, *optional*, defaults to `None`):
            Stop once this many tokens were generated (`max_steps` still bounds the run and sets its
            schedule).

        > Warm start (`model: warm:<preset>`)

        warm_start_target (`float`, *optional*, defaults to `0.3`):
            Supervised training stops once the sampled reward (temperature 1, fixed prompts) reaches this.
        warm_start_seed (`int`, *optional*, defaults to `0`):
            The warm start's own seed: runs with different `seed`s start from one model.
        warm_start_seconds (`float`, *optional*, defaults to `600.0`):
            Supervised training stops after this many seconds if the target is not reached.
        warm_start_split (`str`, *optional*, defaults to `"all"`):
            What the warm start trains on: `"train"`, the training side of the task's held-out split only
            (no stage before RL sees a held-out prompt); `"all"`, the whole prompt space, held-out prompts
            included (the shipped checkpoints that the registered experiments start from).

        > Supervised warm start of a chat model (`otbrl sft`, before RL)

        sft_steps (`int`, *optional*, defaults to `0`):
            Steps of supervised training on worked solutions of the task's training side before RL (`0`:
            none). The warm start is built once per setting, model, library versions and machine kind,
            and cached under `$OTBRL_CACHE/sft/`; every run with the same settings starts from it.
        sft_learning_rate (`float`, *optional*, defaults to `2e-05`):
            Its constant learning rate.
        sft_batch_size (`int`, *optional*, defaults to `8`):
            Worked solutions per step.
        sft_seed (`int`, *optional*, defaults to `0`):
            Which training-side problems and solution styles it draws: runs with different `seed`s start
            from one model.

        > Machine and output

        threads (`int` or `None`, *optional*, defaults to `None`):
            torch threads. `None` keeps torch's default.
        plot (`bool`, *optional*, defaults to `True`):
            Draw `curves.png` in the output directory.

        > OTBGRPOConfig fields whose defaults a recipe changes (`TRAINER_DEFAULTS`)

        What a CPU run needs where TRL's defaults differ (bf16 and gradient checkpointing are on there):
        `output_dir: runs/otbrl`, `bf16: false`, `gradient_checkpointing: false`, `logging_steps: 1`,
        `report_to: [tensorboard]`, `save_strategy: steps`, `save_steps: 50`, `beta: 0.0`, `seed: 0`.
        `bf16` also takes `auto`: bf16 autocast where the hardware computes bf16 natively (a GPU that
        supports it, or a CPU with AMX or AVX-512 BF16), float32 elsewhere; the run says which it chose.
    """

    task: str | None = None
    dataset: str | None = None
    dataset_config: str | None = None
    dataset_split: str = "train"
    dataset_revision: str | None = None
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    chat: bool | None = None
    system_prompt: str | None = None
    chat_template_path: str | None = None
    model: str = "warm:small"
    model_revision: str | None = None
    model_fallback: str | None = None
    sampler: str = "trl"
    compact_decoding: bool = False
    turn_cache: bool = False
    reward: str = "task"
    reward_max_failure_fraction: float = 0.5
    train_size: int = 4096
    eval_size: int = 128
    eval_distinct_problems: bool = False
    eval_samples: int = 1
    eval_batch_size: int | None = None
    eval_at_tokens: list[int] | None = None
    eval_before: bool = True
    eval_before_only: bool = False
    max_generated_tokens: int | None = None
    warm_start_target: float = 0.3
    warm_start_seed: int = 0
    warm_start_seconds: float = 600.0
    warm_start_split: str = "all"
    sft_steps: int = 0
    sft_learning_rate: float = 2e-5
    sft_batch_size: int = 8
    sft_seed: int = 0
    tools: list[str] | None = None
    max_turns: int | None = None
    threads: int | None = None
    plot: bool = True


RECIPE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RecipeKeys)}

# Documented in RecipeKeys' docstring, last section.
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


def key_help() -> dict[str, str]:
    """{key: its help text} for every RecipeKeys field, read from the docstring above (the one place
    they are written), so `otbrl train --help` and the docs say the same."""
    doc = textwrap.dedent(RecipeKeys.__doc__ or "")
    entries = re.findall(r"^ {4}(\w+) \((.*?)\):\n((?: {8}.*\n?)+)", doc, flags=re.M)
    return {name: " ".join(text.split()) for name, _, text in entries}


def keys_epilog(width: int = 100) -> str:
    """The recipe keys with their defaults and help, as `otbrl train --help` lists them."""
    helps = key_help()
    lines = ["otbrl's recipe keys (YAML or --key value; any OTBGRPOConfig field is a key too):", ""]
    for name, default in RECIPE_DEFAULTS.items():
        lines.append(f"  --{name} (default {default!r})")
        lines += textwrap.wrap(helps[name], width, initial_indent="      ", subsequent_indent="      ")
    defaults = ", ".join(f"{k}={v!r}" for k, v in TRAINER_DEFAULTS.items())
    lines += ["", "OTBGRPOConfig fields whose defaults a recipe changes for a CPU run:"]
    lines += textwrap.wrap(defaults, width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines)
