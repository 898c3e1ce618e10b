"""Recipes: a YAML mapping of otbrl keys (task or dataset, model, reward, warm start: documented in
`otbrl.app.config.RecipeKeys`) and `OTBGRPOConfig` fields, checked before anything heavy happens. Every
value is read as its field's type (the types HfArgumentParser derives from the dataclasses, so a recipe
file and the command line agree), then ranges and cross-field rules; each problem is one ValueError
naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import HfArgumentParser

from otbrl.app.answers import get_reward
from otbrl.app.config import RECIPE_DEFAULTS, TRAINER_DEFAULTS, RecipeKeys
from otbrl.app.precision import resolve_bf16
from otbrl.app.sources import chat_template_text
from otbrl.integrations.trl import OTBGRPOConfig
from otbrl.integrations.trl.config import checkpointing_key
from otbrl.rollout.multiturn import resolve_tools
from otbrl.tasks import get_task

RECIPES = Path(__file__).resolve().parent / "recipes"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


# ----------------------------------------------------------------------------------------------------
# Reading values. YAML 1.1 (PyYAML's default) reads `no`/`yes`/`on`/`off` as booleans and `1e-4` as a
# string; recipes follow YAML 1.2 instead: only true/false are booleans and 1e-4 is a float. TRL's and
# transformers' YAML readers (TrlParser, HfArgumentParser.parse_yaml_file) are YAML 1.1 and do not read
# values as their fields' types (tests/app/test_config.py shows both), hence this loader.

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


class _FieldParser(HfArgumentParser):
    """HfArgumentParser that keeps the argparse action it derives for each dataclass field, as
    `add_argument` returns it. A `bool = True` field also gets a `--no_<field>` store-false action with the
    same dest, added after the field's own: the first action of a dest is the one that reads a value."""

    def __init__(self, dataclass_types: list[type]) -> None:
        self.field_actions: dict[str, argparse.Action] = {}
        super().__init__(dataclass_types)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.field_actions.setdefault(action.dest, action)
        return action


@functools.cache
def _schema() -> tuple[dict[str, argparse.Action], dict[str, Any], dict[str, Any]]:
    """(argparse action, type hint, default) of every recipe key, as HfArgumentParser derives them from
    RecipeKeys and OTBGRPOConfig (the same reading `TrlParser` gives a command line)."""
    actions = _FieldParser([RecipeKeys, OTBGRPOConfig]).field_actions
    actions.pop("help")
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
    if key in AUTO_KEYS and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"  # resolved for the machine that trains (make_config), not the one that reads
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
    try:
        return _scalar(key, value, action)
    except ValueError as err:
        if key in AUTO_KEYS:  # the one value the field's own type does not name
            raise ValueError(f"{err} (or auto)") from None
        raise


# ----------------------------------------------------------------------------------------------------
# Loading and checking a recipe.


def read_recipe(config: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A recipe file (or a packaged recipe by name) with `overrides` applied, as written: no defaults, no
    types read, nothing checked (`load_recipe` does that; this is for a look at a few keys)."""
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
    return recipe


def load_recipe(config: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read a recipe file (or a packaged recipe by name), apply overrides, read every value as its
    field's type and check ranges and cross-field rules (ValueError naming the key)."""
    recipe = read_recipe(config, overrides)
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
    positive = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_completion_length",
        "eval_size",
        "eval_samples",
        "eval_batch_size",
        "train_size",
        "threads",
        "max_turns",
        "logging_steps",
        "num_iterations",
    )
    for key in positive:
        _at_least(recipe, key, 1)
    for key in ("learning_rate", "warm_start_target", "beta"):
        _at_least(recipe, key, 0)
    for budget in recipe.get("eval_at_tokens") or []:
        if budget < 1:
            raise ValueError(f"eval_at_tokens: budgets must be >= 1 token, got {budget}")
    _at_least(recipe, "max_generated_tokens", 1)
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
    if not recipe["task"] and not recipe["dataset"]:
        raise ValueError("task: a recipe needs a built-in task or a dataset")
    if recipe["task"]:
        get_task(recipe["task"])  # unknown names fail here
    if recipe["reward"] != "task":
        get_reward(recipe["reward"])
    elif not recipe["task"]:
        raise ValueError("reward: 'task' needs a built-in task; use exact, numeric or math for a dataset")
    synthetic = str(recipe["model"]).partition(":")[0] in ("warm", "random")
    if str(recipe["model"]).startswith("warm") and not recipe["task"]:
        raise ValueError("model: warm:<preset> warm-starts on a built-in task; set task, or give a model")
    tools, turns = tool_settings(recipe)
    if tools:
        if episode_of(recipe) is None:
            resolve_tools(list(tools))  # unknown names fail here
        if turns < 1:
            raise ValueError(f"max_turns: must be >= 1 when tools are given, got {turns}")
    if recipe["chat"] and synthetic:
        raise ValueError("chat: warm:/random: models use a character tokenizer without a chat template")
    if recipe["chat_template_path"]:
        if synthetic:
            raise ValueError("chat_template_path: warm:/random: models use a character tokenizer, no chat")
        chat_template_text(str(recipe["chat_template_path"]))  # a missing file or unknown name fails here
    if recipe["sampler"] not in ("trl", "otbrl"):
        raise ValueError(f"sampler: must be trl or otbrl, got {recipe['sampler']!r}")
    if recipe["sft_steps"] < 0 or recipe["sft_batch_size"] < 1 or recipe["sft_learning_rate"] <= 0:
        raise ValueError("sft_steps must be >= 0, sft_batch_size >= 1 and sft_learning_rate > 0")
    if recipe["sft_steps"] and recipe["chat"] is False:
        raise ValueError("sft_steps: the warm start trains chat messages; it needs chat: true")
    if recipe["sft_steps"] and synthetic:
        raise ValueError(
            "sft_steps: a supervised warm start is for a pretrained chat model, not warm:/random:"
        )
    if recipe["eval_before_only"] and not recipe["eval_before"]:
        raise ValueError("eval_before_only: computes the score before training; it needs eval_before: true")
    if recipe["warm_start_split"] not in ("all", "train"):
        raise ValueError(f"warm_start_split: must be all or train, got {recipe['warm_start_split']!r}")
    options = recipe["estimator_options"]
    if not (options is None or isinstance(options, dict)):  # names and values: OTBGRPOConfig (resolve)
        raise ValueError(f"estimator_options: expected a mapping ({{leave_one_out: true}}), got {options!r}")
    return make_config(given)  # TRL's own checks last: ours name the key and the rule


def tool_settings(recipe: dict[str, Any]) -> tuple[tuple[str, ...], int]:
    """(tool names, max turns) of a recipe: its own keys, else its built-in task's; () means one turn."""
    task = get_task(recipe["task"]) if recipe["task"] else None
    tools = recipe["tools"] if recipe["tools"] is not None else (task.tools if task else ())
    if isinstance(tools, str):
        tools = [tools]
    turns = recipe["max_turns"] if recipe["max_turns"] is not None else (task.max_turns if task else 3)
    return tuple(tools), int(turns)


def episode_of(recipe: dict[str, Any]) -> Any:
    """The recipe's task's `episode` (each completion's own toolbox, `otbrl.tasks.builtin.Task`), unless
    the recipe names its own tools; else None."""
    task = get_task(recipe["task"]) if recipe["task"] else None
    return task.episode if task is not None and recipe["tools"] is None else None


AUTO_KEYS = ("bf16",)  # keys that also take "auto" (otbrl.app.precision)


def make_config(recipe: dict[str, Any]) -> Any:
    """The OTBGRPOConfig of a typed recipe; its own checks (the estimator's options among them, by
    `otbrl.estimators.resolve`) become one-line ValueErrors."""
    fields = {f.name for f in dataclasses.fields(OTBGRPOConfig)}
    values = {k: v for k, v in recipe.items() if k in fields}
    use_cpu = not torch.cuda.is_available()
    values["bf16"] = resolve_bf16(values.get("bf16", False), use_cpu)[0]
    new = checkpointing_key()  # the recipe key keeps TRL's documented name; passed under the current one
    if new != "gradient_checkpointing" and values.get(new) is None and "gradient_checkpointing" in values:
        values[new] = values.pop("gradient_checkpointing")
    try:
        return OTBGRPOConfig(**values, use_cpu=use_cpu)
    except (ValueError, TypeError, ZeroDivisionError) as err:
        raise ValueError(" ".join(str(err).split())) from None
