"""Where a run's prompts and model come from: a built-in task or a warm start, a local file, saved
dataset or model directory, or a Hugging Face Hub id, all through the real loaders; offline, a missing
download is one clear error that says how to use a local copy. Prompts become chat messages for chat
models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
        # Two sides of the task's hash split: no held-out prompt can be drawn for training.
        seed = recipe["seed"]
        return (
            dataset(recipe["task"], recipe["train_size"], seed, split="train"),
            dataset(recipe["task"], recipe["eval_size"], seed + 1, split="heldout"),
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
