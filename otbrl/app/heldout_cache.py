"""One held-out score before training, shared by the runs of an experiment that would compute the same one.

The arms of one seed start from the same model, score the same held-out prompts and sample them with the
same seed: their step-0 held-out reward is one number, computed once per arm (two minutes a run for the
135M model). `otbrl compare` points `OTBRL_HELDOUT_CACHE` at a folder of its runs; a run there keys its
score by everything the number depends on (the weights' bytes, the tokenizer's vocabulary, the prompts and
answers, the sampling settings, the threads, the library versions) and reuses a score written under the
same key. Without the variable every run computes its own, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from otbrl import __version__

ENV = "OTBRL_HELDOUT_CACHE"
EVAL_BEFORE_FILE = "eval-before.json"  # what a run with eval_before_only writes: its step-0 score alone


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer: name, dtype, shape and bytes, in state_dict order."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of the vocabulary and special tokens ("" for the built-in tasks' models, which have none)."""
    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items())
    special = getattr(tokenizer, "all_special_tokens", [])
    return hashlib.sha256(json.dumps([type(tokenizer).__name__, vocab, special]).encode()).hexdigest()


def before_key(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], settings: dict[str, Any]
) -> str:
    """The key of a step-0 held-out score: everything it is a function of. `settings`: the sampling and
    scoring settings (max tokens, temperature, seed, tools, turns, autocast, reward), JSON-able."""
    parts = {
        "weights": weights_digest(model),
        "config": model.config.to_dict() if hasattr(model, "config") else None,  # attention kernel, dtype
        "tokenizer": tokenizer_digest(tokenizer),
        "rows": [[r["prompt"], r["answer"]] for r in rows],
        "settings": settings,
        "threads": torch.get_num_threads(),
        "device": str(getattr(model, "device", "cpu")),  # CPU and GPU sample the same seed differently
        "versions": [torch.__version__, transformers.__version__, __version__],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_score(
    folder: Path | None, key: str, compute: Callable[[], float], seed: int | None = None
) -> tuple[float, bool]:
    """(score, reused): the score written under `key` in `folder`, else `compute()` written there
    (atomically: runs in parallel may race; both write the same number). `folder` None: no cache.
    `seed`, written beside a computed score, is a label only (the key already hashes it): it tells a
    reader of the folder which seed's score an entry is without rebuilding the key."""
    if folder is None:
        return compute(), False
    path = folder / f"{key}.json"
    try:
        return float(json.loads(path.read_text())["score"]), True
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, or torn by a killed run: compute again
    score = compute()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"score": score, **({"seed": int(seed)} if seed is not None else {})}))
    tmp.replace(path)
    return score, False


def cache_folder() -> Path | None:
    """`$OTBRL_HELDOUT_CACHE` as a path, or None when it is unset or empty."""
    value = os.environ.get(ENV)
    return Path(value) if value else None
