"""Where a run's prompts and model come from: a built-in task or a warm start, a local file, saved
dataset or model directory, or a Hugging Face Hub id, all through the real loaders; offline, a missing
download is one clear error that says how to use a local copy. Prompts become chat messages for chat
models.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from otbrl.tasks import dataset

# torch, transformers, datasets and huggingface_hub load inside the functions that use them: the recipe
# checks import this module and must stay quick (a bad recipe fails in well under a second).

# Data: a built-in task, a local file or saved dataset, or a Hugging Face Hub dataset.

_DATA_FILES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?$")


def _offline() -> bool:
    return any(
        os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


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
    """(train rows, eval rows), each {"prompt", "answer"}, of a checked recipe (a task or a dataset, not
    both); columns are checked before any training."""
    if recipe["task"]:
        # Two sides of the task's hash split: no held-out prompt can be drawn for training.
        seed = recipe["seed"]
        return (
            dataset(recipe["task"], recipe["train_size"], seed, split="train"),
            dataset(
                recipe["task"],
                recipe["eval_size"],
                seed + 1,
                split="heldout",
                distinct_problems=recipe["eval_distinct_problems"],
            ),
        )
    data = _load_data(recipe)  # a checked recipe has a task or a dataset
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
        raise ValueError(
            f"chat: the tokenizer of {recipe['model']} has no chat template; {template_hint()}, "
            "or set chat: false"
        )
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
    """(where from, from_pretrained keywords) of a local directory, a GGUF file (as its cached plain
    checkpoint) or a Hub model id."""
    spec = str(recipe["model"])
    path = Path(spec).expanduser()
    options = {"trust_remote_code": bool(recipe.get("trust_remote_code", False))}
    gguf = gguf_file(spec)
    if gguf is not None:
        return str(plain_checkpoint(gguf, print)), options
    if path.is_dir():
        return str(path), options
    if not _HUB_ID.match(spec) or spec.startswith((".", "~")):
        raise ValueError(
            f"model: {spec!r} is not warm:<preset>, random:<preset>, a local model directory, a .gguf file "
            "or a Hub id"
        )
    return spec, {**options, "revision": recipe.get("model_revision")}


# ----------------------------------------------------------------------------------------------------
# GGUF files (llama.cpp's format, often the only way a model ships in a package): transformers reads and
# dequantises them, but the loaded model keeps a quantizer flag that Trainer refuses. So a GGUF file is
# turned once into a plain float32 checkpoint (with the tokenizer and chat template it carries) in a cache
# keyed by the file's content, and every run loads that folder like any other.

PACKAGE = "package:"  # package:<importable package>/<file inside it>, e.g. a model shipped in a wheel


def gguf_file(spec: str) -> Path | None:
    """The GGUF file `spec` names: a `.gguf` file, a folder holding exactly one, or
    `package:<package>/<file>` inside an installed Python package. None when `spec` names no GGUF."""
    if spec.startswith(PACKAGE):
        return _packaged_file(spec[len(PACKAGE) :])
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: {spec}: no such GGUF file")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise ValueError(f"model: {spec} holds several GGUF files ({names}); name one")
        return found[0] if found else None
    return None


def _packaged_file(where: str) -> Path:
    package, _, name = where.partition("/")
    # find_spec locates the package without running its __init__ (which may need absent dependencies).
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {PACKAGE}{where}: the Python package {package!r} is not installed "
            "(a recipe's comments say how to install it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not name or not path.is_file():
        raise ValueError(f"model: {PACKAGE}{where}: package {package} has no file {name!r}")
    return path


def cache_dir() -> Path:
    """Where converted models live: $OTBRL_CACHE, else ~/.cache/otbrl."""
    return Path(os.environ.get("OTBRL_CACHE") or "~/.cache/otbrl").expanduser()


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def plain_checkpoint(gguf: Path, log: Callable[[str], Any]) -> Path:
    """The cached plain float32 checkpoint of a GGUF file, made on first use (atomically: a killed
    conversion leaves no half folder behind)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = cache_dir() / "gguf" / f"{gguf.stem}-{_digest(gguf)}"
    if (dest / "config.json").is_file():
        return dest
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model: reading {gguf.name} needs the gguf package: pip install 'otbrl[gguf]'")
    log(f"model: converting {gguf.name} to a plain float32 checkpoint (once) in {dest}")
    source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001  -- a missing `gguf` package, an unknown architecture, ...
        raise ValueError(f"model: could not read the GGUF file {gguf} ({_first_line(err)})") from None
    # The weights are plain floats now; only the flags still say "quantized".
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    work = dest.with_name(f"{dest.name}.part{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)
    try:
        work.rename(dest)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(work, ignore_errors=True)
    return dest


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers on its port: one quick try, where a from_pretrained call with
    no network spends about a minute on retries before it fails."""
    if _offline():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def choose_model(recipe: dict[str, Any], log: Callable[[str], Any]) -> dict[str, Any]:
    """The recipe with `model` set to what this machine can load: a Hub id that can be neither fetched
    nor found in the cache gives way to `model_fallback` (said in the log); everything else is kept."""
    spec, fallback = str(recipe["model"]), recipe.get("model_fallback")
    hub = _HUB_ID.match(spec) and not Path(spec).expanduser().exists() and ":" not in spec
    if not fallback or not hub or hub_reachable():
        return recipe
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(spec, "config.json", revision=recipe.get("model_revision"))
    if isinstance(cached, str):  # the cached snapshot is a plain model folder
        log(f"model: the Hugging Face Hub is out of reach; {spec} loads from the cache")
        return {**recipe, "model": str(Path(cached).parent)}
    log(f"model: the Hugging Face Hub is out of reach and {spec} is not cached: using {fallback}")
    return {**recipe, "model": fallback}


def model_problem(recipe: dict[str, Any]) -> str | None:
    """Why this machine cannot load the recipe's model, found without loading it (None: no problem that a
    look can find): the source `choose_model` picks is a GGUF file, a packaged file or a folder that is not
    there. A runner asks before it starts many runs, each of which would fail on the same missing model."""
    try:
        chosen = str(choose_model(recipe, lambda _: None)["model"])
        if chosen.startswith("random:") or gguf_file(chosen) is not None:
            return None
    except ValueError as err:
        return str(err)
    if chosen.startswith((".", "/", "~")) and not Path(chosen).expanduser().exists():
        return f"model: {chosen}: no such folder"
    return None


def _init_kwargs(recipe: dict[str, Any]) -> dict[str, Any]:
    init = recipe.get("model_init_kwargs") or {}
    return json.loads(init) if isinstance(init, str) else dict(init)


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


# ----------------------------------------------------------------------------------------------------
# Chat templates: a base model's tokenizer (a GGUF file of a pretrained, not instruction-tuned, model)
# often has none, and without one there are no chat prompts, no tool turns and no warm start.

TEMPLATES = Path(__file__).parent / "templates"  # the templates otbrl ships, by name: gemma -> gemma.jinja


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def template_hint() -> str:
    """How to give a tokenizer that has no chat template one: the end of every error that finds none."""
    names = ", ".join(shipped_templates())
    return f"give one with chat_template_path (a .jinja file, or one of otbrl's: {names})"


def chat_template_text(spec: str) -> str:
    """The Jinja text of a `chat_template_path`: a `.jinja`/`.j2` file, or the name of a shipped template."""
    path = Path(spec).expanduser()
    if path.suffix not in (".jinja", ".j2"):
        if spec not in shipped_templates():
            raise ValueError(
                f"chat_template_path: {spec!r} is neither a .jinja/.j2 file nor one of otbrl's templates "
                f"{shipped_templates()}"
            )
        path = TEMPLATES / f"{spec}.jinja"
    if not path.is_file():
        raise ValueError(f"chat_template_path: {spec}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"chat_template_path: {spec} is empty")
    return text


def load_tokenizer(recipe: dict[str, Any]) -> Any:
    """The tokenizer of a local directory, GGUF file or Hub model id (a pad token added when it has none,
    the recipe's `chat_template_path` in place of its chat template when given)."""
    from transformers import AutoTokenizer

    where, options = _pretrained(recipe)
    tokenizer = _fetch("tokenizer", where, options, lambda: AutoTokenizer.from_pretrained(where, **options))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if recipe.get("chat_template_path"):
        tokenizer.chat_template = chat_template_text(str(recipe["chat_template_path"]))
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
            split=recipe["warm_start_split"],
            log=log,
        )
        return model, tokenizer
    if kind == "random":
        from otbrl.tasks import char_tokenizer, tiny_model

        return tiny_model(preset or "small", seed=recipe.get("seed", 0)), char_tokenizer()
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(recipe)
    where, options = _pretrained(recipe)
    options = {"dtype": "auto", **options, **_init_kwargs(recipe)}
    model = _fetch("model", where, options, lambda: AutoModelForCausalLM.from_pretrained(where, **options))
    return model, tokenizer
