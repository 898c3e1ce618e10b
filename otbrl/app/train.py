"""Run a training recipe: a YAML mapping of otbrl keys (task or dataset, model, reward, warm start) and
`OTBGRPOConfig` fields. A run writes checkpoints, TensorBoard logs, `metrics.jsonl` (one line per step,
with the cumulative number of generated tokens and train seconds), `summary.md`, `summary.json` and
`curves.png` under its output_dir.

Recipes are checked before anything heavy happens: every value is read as its field's type (the types
HfArgumentParser derives from the dataclasses, so a recipe file and the command line agree), then ranges
and cross-field rules; each problem is one ValueError naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import inspect
import json
import math
import re
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

RECIPES = Path(__file__).resolve().parent / "recipes"


@dataclasses.dataclass
class RecipeKeys:
    """otbrl's own recipe keys; every other key must be an OTBGRPOConfig field."""

    task: str | None = None  # a built-in task (otbrl.tasks.TASKS) ...
    # ... or a dataset with prompt and answer columns: a JSONL/JSON/CSV/Parquet file, a
    # datasets.save_to_disk directory, or a Hugging Face Hub dataset name (ORG/NAME)
    dataset: str | None = None
    dataset_config: str | None = None  # the hub dataset's configuration (e.g. gsm8k's "main")
    dataset_split: str = "train"
    dataset_revision: str | None = None
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    # Chat prompts (lists of {"role", "content"} messages through the tokenizer's chat template).
    # None: chat when the tokenizer has a chat template (instruct models), plain text otherwise.
    chat: bool | None = None
    system_prompt: str | None = None  # the system message of chat prompts
    # warm:<preset> (cached supervised warm start), random:<preset>, a local model directory, or a Hub
    # model id (ORG/NAME, downloaded on a connected machine; from the cache under HF_HUB_OFFLINE=1)
    model: str = "warm:small"
    model_revision: str | None = None  # a Hub branch, tag or commit
    reward: str = "task"  # task (the built-in task's exact reward), exact, numeric or math
    # The run stops when the reward function fails on every sample of a batch, or on more than this
    # fraction of all samples scored so far.
    reward_max_failure_fraction: float = 0.5
    train_size: int = 4096  # prompts drawn for a built-in task
    eval_size: int = 128  # held-out prompts scored before and after training
    warm_start_target: float = 0.3
    warm_start_seed: int = 0  # the warm start's own seed: runs with different `seed`s start from one model
    warm_start_seconds: float = 600.0
    tools: list[str] | None = None  # tool names for multi-turn rollouts (otbrl.rollout); None: the task's
    max_turns: int | None = None  # tool calls per completion; None: the task's (3 without a task)
    threads: int | None = None  # torch threads; None keeps torch's default
    plot: bool = True


RECIPE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RecipeKeys)}

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


# ----------------------------------------------------------------------------------------------------
# Reading values. YAML 1.1 (PyYAML's default) reads `no`/`yes`/`on`/`off` as booleans and `1e-4` as a
# string; recipes follow YAML 1.2 instead: only true/false are booleans and 1e-4 is a float.

_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's booleans (true/false only) and floats (exponent without a dot)."""


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_RecipeLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(text: str, what: str = "value") -> Any:
    """YAML 1.2 scalars (see _RecipeLoader); a syntax error is a one-line ValueError naming `what`."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(f"{what}: not valid YAML{where}: {' '.join(str(problem).split())}") from None


def parse_value(text: str) -> Any:
    """A command-line override value read as YAML 1.2 (numbers, booleans, lists, JSON-style mappings);
    text that is not valid YAML stays a string."""
    try:
        return read_yaml(text)
    except ValueError:
        return text


@functools.cache
def _schema() -> tuple[dict[str, argparse.Action], dict[str, Any], dict[str, Any]]:
    """(argparse action, type hint, default) of every recipe key, as HfArgumentParser derives them from
    RecipeKeys and OTBGRPOConfig (the same reading `TrlParser` gives a command line)."""
    from transformers import HfArgumentParser

    from otbrl.integrations.trl import OTBGRPOConfig

    parser = HfArgumentParser([RecipeKeys, OTBGRPOConfig])
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    hints = {**typing.get_type_hints(OTBGRPOConfig), **typing.get_type_hints(RecipeKeys)}
    defaults = {f.name: f.default for f in dataclasses.fields(OTBGRPOConfig)} | RECIPE_DEFAULTS
    return actions, hints, defaults


def _shapes(hint: Any) -> set[str]:
    """Which of 'list', 'dict', 'none' a type hint admits besides scalars."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    out = set()
    for a in args:
        origin = typing.get_origin(a) or a
        if a is type(None):
            out.add("none")
        elif origin in (list, tuple):
            out.add("list")
        elif origin is dict:
            out.add("dict")
    return out


def _describe(convert: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string"}.get(convert, "true or false")


def _scalar(key: str, value: Any, action: argparse.Action) -> Any:
    """One value read as the field's type, as argparse would read it from the command line."""
    if isinstance(value, list | dict):
        raise ValueError(f"{key}: expected a single value, got {value!r}")
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    convert = action.type or str
    if convert in (int, float) and isinstance(value, bool):
        raise ValueError(f"{key}: expected {_describe(convert)}, got {value!r}")
    try:
        out = convert(text)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ValueError(f"{key}: expected {_describe(convert)}, got {value!r}") from None
    if action.choices is not None:
        names = [str(c.value if isinstance(c, enum.Enum) else c) for c in action.choices]
        if text not in names:
            raise ValueError(f"{key}: must be one of {', '.join(names)}; got {value!r}")
    return out.value if isinstance(out, enum.Enum) else out


def coerce(key: str, value: Any) -> Any:
    """`value` (from YAML or a command line) as the type of recipe key `key`: strings stay strings
    (`no` for save_strategy), numbers are numbers (1e-4), lists and mappings only where the field takes
    them. A string for a list or mapping field is read as YAML (`[calc]`, `{leave_one_out: true}`)."""
    actions, hints, defaults = _schema()
    action, shapes = actions[key], _shapes(hints[key])
    if value is None or (isinstance(value, str) and value in ("null", "~") and "none" in shapes):
        if "none" in shapes or defaults.get(key) is None:
            return None
        raise ValueError(f"{key}: needs a value (default {defaults.get(key)!r})")
    if isinstance(value, str) and shapes & {"list", "dict"}:
        parsed = parse_value(value)
        value = parsed if isinstance(parsed, list | dict) else value
    elif isinstance(value, str) and len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        value = parse_value(value)  # a quoted command-line value: '"Answer: 42"' is the string in quotes
    if isinstance(value, dict):
        if "dict" not in shapes:
            raise ValueError(f"{key}: expected a single value, not a mapping {value!r}")
        return value
    if isinstance(value, list | tuple):
        if "list" not in shapes:
            raise ValueError(f"{key}: expected a single value, not a list {list(value)!r}")
        return [_scalar(key, v, action) for v in value]
    if "list" in shapes and action.nargs in ("+", "*"):
        return [_scalar(key, value, action)]
    return _scalar(key, value, action)


# ----------------------------------------------------------------------------------------------------
# Loading and checking a recipe.


def load_recipe(config: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a recipe file (or a packaged recipe by name), apply overrides, read every value as its
    field's type and check ranges and cross-field rules (ValueError naming the key)."""
    path = Path(config)
    if not path.is_file():
        path = RECIPES / f"{config}.yaml"
        if not path.is_file():
            known = ", ".join(recipe_names())
            raise ValueError(f"config: no file {config!r} and no packaged recipe of that name ({known})")
    recipe = read_yaml(path.read_text(), f"config {path}") or {}
    if not isinstance(recipe, dict):
        raise ValueError(f"config: {path} must hold a mapping of keys to values")
    overrides = dict(overrides or {})
    if overrides.get("dataset") and "task" not in overrides:
        recipe.pop("task", None)  # a dataset given over a task recipe replaces the task
    if overrides.get("task") and "dataset" not in overrides:
        recipe.pop("dataset", None)
    recipe.update(overrides)
    _, _, defaults = _schema()
    known = set(defaults)
    for key in recipe:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"{key}: not a recipe key (otbrl keys: {', '.join(RECIPE_DEFAULTS)}; "
                f"or any OTBGRPOConfig field){hint}"
            )
    full = {**RECIPE_DEFAULTS, **TRAINER_DEFAULTS, **recipe}
    full = {k: coerce(k, v) for k, v in full.items()}
    check_recipe(full)
    return full


def _at_least(recipe: dict[str, Any], key: str, low: float, strict: bool = False) -> None:
    v = recipe.get(key)
    if v is None:
        return
    if not math.isfinite(v) or (v <= low if strict else v < low):
        raise ValueError(f"{key}: must be {'>' if strict else '>='} {low}, got {v!r}")


def check_recipe(recipe: dict[str, Any]) -> Any:
    """Ranges and cross-field rules of a typed recipe; returns its OTBGRPOConfig. Cheap: no data, no
    model."""
    given, recipe = recipe, {**_schema()[2], **recipe}  # dataclass defaults of keys left out
    positive = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length",
                "eval_size", "train_size", "threads", "max_turns", "logging_steps",
                "num_iterations")  # fmt: skip
    for key in positive:
        _at_least(recipe, key, 1)
    for key in ("learning_rate", "warm_start_target", "beta"):
        _at_least(recipe, key, 0)
    for key in ("temperature", "warm_start_seconds", "save_steps"):
        _at_least(recipe, key, 0, strict=True)
    _at_least(recipe, "num_generations", 2)  # a group of one has no baseline
    if recipe["max_steps"] == 0 or recipe["max_steps"] < -1:
        steps = recipe["max_steps"]
        raise ValueError(f"max_steps: must be >= 1 (or -1: num_train_epochs decides), got {steps}")
    fraction = recipe["reward_max_failure_fraction"]
    if not 0 < fraction <= 1:
        raise ValueError(f"reward_max_failure_fraction: must be in (0, 1], got {fraction!r}")
    if recipe.get("generation_batch_size") is None and recipe.get("steps_per_generation") is None:
        batch = recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"]
        if batch % recipe["num_generations"]:
            raise ValueError(
                f"per_device_train_batch_size: per_device_train_batch_size x gradient_accumulation_steps "
                f"({batch}) must be divisible by num_generations ({recipe['num_generations']})"
            )
    if recipe["task"] and recipe["dataset"]:
        raise ValueError("dataset: give either task or dataset, not both")
    if recipe["task"]:
        from otbrl.tasks import get_task

        get_task(recipe["task"])  # unknown names fail here
    if recipe["reward"] != "task":
        from otbrl.app.rewards import get_reward

        get_reward(recipe["reward"])
    elif recipe["dataset"]:
        raise ValueError("reward: 'task' needs a built-in task; use exact, numeric or math for a dataset")
    synthetic = str(recipe["model"]).partition(":")[0] in ("warm", "random")
    if recipe["chat"] and synthetic:
        raise ValueError("chat: warm:/random: models use a character tokenizer without a chat template")
    if recipe["chat"] and recipe["tools"]:
        raise ValueError("chat: tool rollouts take plain-text prompts; set chat: false or drop tools")
    check_estimator_options(recipe["advantage_estimator"], recipe["estimator_options"])
    return make_config(given)  # TRL's own checks last: ours name the key and the rule


def check_estimator_options(name: str, options: Any) -> None:
    """Each option's value has the type of the estimator's keyword default: a quoted "false" is not a
    boolean (it would be truthy)."""
    import otbrl

    if isinstance(options, str):
        options = parse_value(options)
    if options is None:
        return
    if not isinstance(options, dict):
        raise ValueError(f"estimator_options: expected a mapping ({{leave_one_out: true}}), got {options!r}")
    spec = otbrl.ESTIMATORS.get(name)
    if spec is None:
        return  # OTBGRPOConfig names the unknown estimator
    params = inspect.signature(spec.fn).parameters
    for key, value in options.items():
        default = params[key].default if key in params else None
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int | float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            want = _describe(bool if isinstance(default, bool) else type(default))
            raise ValueError(f"estimator_options: {key} must be {want} (like {default!r}), got {value!r}")


def make_config(recipe: dict[str, Any]) -> Any:
    """The OTBGRPOConfig of a typed recipe; its own checks become one-line ValueErrors."""
    from otbrl.integrations.trl import OTBGRPOConfig

    fields = {f.name for f in dataclasses.fields(OTBGRPOConfig)}
    try:
        return OTBGRPOConfig(
            **{k: v for k, v in recipe.items() if k in fields}, use_cpu=not torch.cuda.is_available()
        )
    except (ValueError, TypeError, ZeroDivisionError) as err:
        raise ValueError(" ".join(str(err).split())) from None


# ----------------------------------------------------------------------------------------------------
# Data: a built-in task, a local file or saved dataset, or a Hugging Face Hub dataset.

_DATA_FILES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?$")


def _offline() -> bool:
    import os

    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))  # fmt: skip


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".strip()


def _load_data(recipe: dict[str, Any]) -> Any:
    """The dataset named by the recipe: a file, a saved dataset, a data folder, or a Hub dataset."""
    import datasets

    spec = str(recipe["dataset"])
    source = Path(spec).expanduser()
    split = recipe["dataset_split"]
    if source.is_file():
        kind = _DATA_FILES.get(source.suffix.lower())
        if kind is None:
            raise ValueError(f"dataset: {source}: unknown file type (use {', '.join(_DATA_FILES)})")
        return datasets.load_dataset(kind, data_files=str(source), split="train")
    if source.is_dir():
        saved = (source / "dataset_dict.json").is_file() or (source / "state.json").is_file()
        data = datasets.load_from_disk(str(source)) if saved else datasets.load_dataset(str(source))
    elif not _HUB_ID.match(spec):
        raise ValueError(f"dataset: {spec} is not a file, a saved dataset directory or a Hub name (ORG/NAME)")
    else:
        try:
            data = datasets.load_dataset(
                spec, recipe["dataset_config"], split=split, revision=recipe["dataset_revision"]
            )
        except Exception as err:  # noqa: BLE001  -- network, cache and name errors all end here
            where = f"{spec}" + (f" (config {recipe['dataset_config']})" if recipe["dataset_config"] else "")
            hint = (
                "offline (HF_HUB_OFFLINE=1): only datasets already in the cache ($HF_HOME) load; fetch it "
                "once on a connected machine, or"
                if _offline()
                else "check the name, dataset_config and dataset_split, or"
            )
            raise ValueError(
                f"dataset: could not load {where} split {split!r} from the Hugging Face Hub "
                f"({_first_line(err)}); {hint} give a local copy: a JSONL file or a save_to_disk directory"
            ) from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"dataset_split: {split!r} is not a split of {spec} (splits: {', '.join(data)})")
        data = data[split]
    return data


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
    data = _load_data(recipe)
    columns = {"prompt": recipe["prompt_column"], "answer": recipe["answer_column"]}
    missing = [c for c in columns.values() if c not in data.column_names]
    if missing:
        have = ", ".join(data.column_names)
        raise ValueError(
            f"dataset: rows lack column {missing[0]!r} (columns: {have}); set prompt_column / answer_column"
        )
    rows = [{"prompt": str(r[columns["prompt"]]), "answer": str(r[columns["answer"]])} for r in data]
    if len(rows) < 2:
        raise ValueError(f"dataset: needs at least 2 rows, has {len(rows)}")
    cut = max(1, min(recipe["eval_size"], len(rows) // 10))
    return rows[cut:], rows[:cut]


def check_enough_rows(train_rows: list[dict], config: Any, key: str = "dataset") -> None:
    """One step needs generation_batch_size / num_generations distinct prompts (TRL drops a short last
    batch, so fewer train zero steps). `key` names the recipe key to blame."""
    need = config.generation_batch_size // config.num_generations
    if len(train_rows) < need:
        where = "after the held-out split" if key == "dataset" else "drawn"
        raise ValueError(
            f"{key}: {len(train_rows)} training prompt(s) {where}, but one step needs "
            f"{need} (per_device_train_batch_size x gradient_accumulation_steps / num_generations); "
            "add rows or lower per_device_train_batch_size"
        )


def as_chat(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    """A prompt as chat messages (TRL's conversational format)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": prompt}]


def shape_prompts(
    recipe: dict[str, Any], tokenizer: Any, train_rows: list[dict], eval_rows: list[dict], config: Any
) -> tuple[list[dict], list[dict], bool]:
    """Chat or plain prompts: (train rows for TRL, eval rows as text, chat?). Chat train prompts are
    message lists (TRL applies the chat template); eval prompts are the same template rendered to text."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    chat = recipe["chat"] if recipe["chat"] is not None else has_template
    system = recipe["system_prompt"]
    if not chat:
        prefix = f"{system}\n\n" if system else ""
        return (
            [{**r, "prompt": prefix + r["prompt"]} for r in train_rows],
            [{**r, "prompt": prefix + r["prompt"]} for r in eval_rows],
            False,
        )
    if not has_template:
        raise ValueError(f"chat: the tokenizer of {recipe['model']} has no chat template; set chat: false")
    kwargs = dict(config.chat_template_kwargs or {})
    render = lambda p: tokenizer.apply_chat_template(  # noqa: E731
        as_chat(p, system), tokenize=False, add_generation_prompt=True, **kwargs
    )
    return (
        [{**r, "prompt": as_chat(r["prompt"], system)} for r in train_rows],
        [{**r, "prompt": render(r["prompt"])} for r in eval_rows],
        True,
    )


# ----------------------------------------------------------------------------------------------------
# Models: warm starts, random tiny models, local directories and Hub ids, through the same loaders.


def _pretrained(recipe: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(where from, from_pretrained keywords) of a local directory or a Hub model id."""
    spec = str(recipe["model"])
    path = Path(spec).expanduser()
    options = {"trust_remote_code": bool(recipe.get("trust_remote_code", False))}
    if path.is_dir():
        return str(path), options
    if not _HUB_ID.match(spec) or spec.startswith((".", "~")):
        raise ValueError(
            f"model: {spec!r} is not warm:<preset>, random:<preset>, a local model directory or a Hub id"
        )
    return spec, {**options, "revision": recipe.get("model_revision")}


def _fetch(what: str, spec: str, options: dict[str, Any], load: Callable[[], Any]) -> Any:
    """Run a from_pretrained call; a failure becomes one line that says what could not be fetched."""
    try:
        return load()
    except Exception as err:  # noqa: BLE001  -- network, cache, auth and format errors all end here
        if Path(spec).is_dir():
            raise ValueError(f"model: could not load the {what} from {spec} ({_first_line(err)})") from None
        revision = f" at revision {options['revision']}" if options.get("revision") else ""
        hint = (
            "offline (HF_HUB_OFFLINE=1): the model must be in the Hugging Face cache ($HF_HOME/hub); "
            f"fetch it once on a connected machine (`hf download {spec}`), or"
            if _offline()
            else "check the id (and HF_TOKEN for gated models), or"
        )
        raise ValueError(
            f"model: could not fetch the {what} of {spec}{revision} from the Hugging Face Hub "
            f"({_first_line(err)}); {hint} give a local directory written by save_pretrained"
        ) from None


def load_tokenizer(recipe: dict[str, Any]) -> Any:
    """The tokenizer of a local directory or Hub model id (a pad token added when it has none)."""
    from transformers import AutoTokenizer

    where, options = _pretrained(recipe)
    tokenizer = _fetch("tokenizer", where, options, lambda: AutoTokenizer.from_pretrained(where, **options))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(recipe: dict[str, Any], log: Callable[[str], Any], tokenizer: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) of warm:<preset>, random:<preset>, a local directory or a Hub model id."""
    spec = str(recipe["model"])
    kind, _, preset = spec.partition(":")
    if kind == "warm":
        from otbrl.tasks import warm_start

        if not recipe.get("task"):
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

        return tiny_model(preset or "small", seed=recipe.get("seed", 0)), char_tokenizer()
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(recipe)
    where, options = _pretrained(recipe)
    init = recipe.get("model_init_kwargs") or {}
    if isinstance(init, str):
        init = json.loads(init)
    options = {"dtype": "auto", **options, **init}
    model = _fetch("model", where, options, lambda: AutoModelForCausalLM.from_pretrained(where, **options))
    return model, tokenizer


def make_reward(recipe: dict[str, Any]) -> Callable[..., list[float]]:
    from otbrl.app.rewards import completion_text, get_reward

    if recipe["reward"] == "task":
        from otbrl.tasks import get_task

        if not recipe["task"]:
            raise ValueError("reward: 'task' needs a built-in task; use exact, numeric or math for a dataset")
        task = get_task(recipe["task"])

        def task_reward(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
            return [task.reward(completion_text(c), a) for c, a in zip(completions, answer, strict=True)]

        task_reward.__name__ = f"{task.name}_reward"
        return task_reward
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
        """One JSON line per logged step, plus the cumulative counts of generated tokens and train
        seconds (both continued across a resume)."""

        generated = 0.0
        seconds = 0.0
        clock = 0.0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            # On resume keep the lines up to the checkpoint's step and continue its counts.
            self.clock = time.perf_counter()
            if path.is_file():
                kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                kept = [r for r in kept if r.get("step", 0) <= state.global_step]
                path.write_text("".join(json.dumps(r) + "\n" for r in kept))
                self.generated = kept[-1].get("generated_tokens", 0.0) if kept else 0.0
                self.seconds = kept[-1].get("train_seconds", 0.0) if kept else 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            logs = dict(logs or {})
            now = time.perf_counter()
            self.seconds, self.clock = self.seconds + now - self.clock, now
            if "completions/mean_length" in logs:
                self.generated += logs["completions/mean_length"] * tokens_per_step
            if "loss" in logs or "reward" in logs:
                row = {"step": state.global_step, "generated_tokens": self.generated,
                       "train_seconds": round(self.seconds, 3), **logs}  # fmt: skip
                with path.open("a") as f:
                    f.write(json.dumps(row) + "\n")

    return MetricsJsonl()


def _progress_callback(tokens_per_step: int, bar: bool) -> Any:
    from transformers import TrainerCallback

    class CompactProgress(TrainerCallback):
        """A progress bar (or, with disable_tqdm, one line per log) showing step, reward, grad norm and
        generated tokens/s, in place of transformers' per-step dict of every metric."""

        def __init__(self) -> None:
            self.bar: Any = None
            self.clock, self.step = 0.0, 0

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.clock, self.step = time.perf_counter(), state.global_step
            if bar and state.is_world_process_zero:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step")

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if not state.is_world_process_zero or not logs or ("loss" not in logs and "reward" not in logs):
                return
            now = time.perf_counter()
            tokens = logs.get("completions/mean_length", 0.0) * tokens_per_step
            parts = [f"reward {logs['reward']:.3f}" if "reward" in logs else None,
                     f"grad norm {logs['grad_norm']:.3g}" if "grad_norm" in logs else None,
                     f"{tokens / max(now - self.clock, 1e-9):,.0f} tok/s"]  # fmt: skip
            text = "  ".join(p for p in parts if p)
            if self.bar is not None:
                self.bar.update(state.global_step - self.step)
                self.bar.set_postfix_str(text, refresh=True)
            else:
                print(f"step {state.global_step}/{state.max_steps}  {text}", flush=True)
            self.clock, self.step = now, state.global_step

        def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    return CompactProgress()


def checkpoint_problems(path: Path) -> list[str]:
    """What is missing or torn in a checkpoint directory (empty when it looks complete)."""
    problems = []
    state = path / "trainer_state.json"
    if not state.is_file():
        problems.append("no trainer_state.json")
    else:
        try:
            json.loads(state.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            problems.append("trainer_state.json is not valid JSON")
    files = [f for f in path.iterdir() if f.is_file()]
    if not any(f.suffix in (".safetensors", ".bin") for f in files):
        problems.append("no model weights")
    problems += [f"{f.name} is empty" for f in sorted(files) if f.stat().st_size == 0]
    return problems


def resume_checkpoint(out: Path, log: Callable[[str], Any]) -> Path | None:
    """The newest complete checkpoint-<step> in `out`; newer incomplete ones (a run killed while saving)
    are reported and skipped."""
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.rpartition("-")[2].isdigit()]
    for path in sorted(found, key=lambda p: int(p.name.rpartition("-")[2]), reverse=True):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        log(f"{path.name} is incomplete ({', '.join(problems)}): skipped")
    return None


def reward_failures(metrics: Path) -> int:
    """Reward-function failures over a whole run: otb/reward_failures is a running count that restarts
    at 0 in each process (a resumed run)."""
    total, last = 0.0, 0.0
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        value = json.loads(line).get("otb/reward_failures") if line.strip() else None
        if value is not None:
            total += value - last if value >= last else value
            last = value
    return int(total)


def run(recipe: dict[str, Any], resume: bool = False, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Train as the recipe says. Returns the summary (also written to output_dir/summary.md)."""
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from otbrl.integrations.trl import OTBGRPOTrainer
    from otbrl.integrations.trl.rewards import GuardedReward

    if recipe["threads"]:
        torch.set_num_threads(int(recipe["threads"]))
    torch.manual_seed(recipe["seed"])
    # Everything that can be wrong with the recipe fails here, before a warm start or a model load.
    config = check_recipe(recipe)
    train_rows, eval_rows = load_rows(recipe)
    check_enough_rows(train_rows, config, "train_size" if recipe["task"] else "dataset")
    if str(recipe["model"]).startswith("warm") and not recipe["task"]:
        raise ValueError("model: warm:<preset> warm-starts on a built-in task; set task, or give a model")
    reward = GuardedReward(make_reward(recipe), max_failure_fraction=recipe["reward_max_failure_fraction"])
    tools, max_turns = tool_settings(recipe)
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
    from otbrl.rollout import evaluate

    # Its own guard: held-out failures are reported (and can stop the run) without counting as training's.
    fraction = recipe["reward_max_failure_fraction"]
    eval_reward = GuardedReward(make_reward(recipe), max_failure_fraction=fraction)

    def score(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return eval_reward(prompts=prompts, completions=completions, answer=answers)

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
    metrics = out / "metrics.jsonl"
    trainer.add_callback(_metrics_callback(metrics, config.generation_batch_size))
    for printer in (ProgressCallback, PrinterCallback):  # they print every step's dict of ~30 metrics
        trainer.remove_callback(printer)
    trainer.add_callback(_progress_callback(config.generation_batch_size, bar=not config.disable_tqdm))
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    if not metrics.is_file():
        raise ValueError(f"max_steps: no training step ran (max_steps {config.max_steps})")
    trainer.save_model(str(out / "final"))
    after = evaluate_now()
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    seconds = rows[-1].get("train_seconds", 0.0) if rows else 0.0  # the whole run, resumed parts too
    summary = summarise(metrics, config, before, after, seconds)
    summary["reward failures"] = reward_failures(metrics)
    (out / "summary.md").write_text(summary_table(summary) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if recipe["plot"]:
        plot_curves(
            metrics, out / "curves.png", title=f"{config.advantage_estimator}, N={config.num_generations}"
        )
    return summary


def written(out: Path) -> list[str]:
    """What a run left in its output_dir, for the closing message."""
    names = [n for n in ("summary.md", "summary.json", "metrics.jsonl", "curves.png", "recipe.yaml")
             if (out / n).is_file()]  # fmt: skip
    if next(out.rglob("events.out.tfevents*"), None) is not None:
        names.append("TensorBoard logs")
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*") if p.is_dir())
    if checkpoints:
        names.append(f"checkpoints ({', '.join(checkpoints)})")
    if (out / "final").is_dir():
        names.append("final (the trained model)")
    return names


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
