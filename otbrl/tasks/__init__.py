"""Built-in verifiable tasks for tiny models (`builtin`) and for pretrained chat models (`chat`), a
character tokenizer, a tiny Qwen2 factory (`models`) and a cached supervised warm start (`warmstart`).

`otbrl.tasks.builtin` and the tokenizer constants are pure Python (torch alone suffices); the model and
warm-start names load transformers on first use (the `trl` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

from otbrl.tasks.builtin import TASKS, Task, dataset, get_task
from otbrl.tasks.chat import CHAT_TASKS
from otbrl.tasks.chat_problems import PROBLEM_TASKS
from otbrl.tasks.tokenizer import VOCAB_SIZE, char_tokenizer

TASKS.update(CHAT_TASKS)  # one registry: recipes name chat tasks like the built-in ones
TASKS.update(PROBLEM_TASKS)

_LAZY = {
    "PRESETS": "models",
    "tiny_model": "models",
    "warm_start": "warmstart",
}

__all__ = [
    "TASKS",
    "VOCAB_SIZE",
    "Task",
    "char_tokenizer",
    "dataset",
    "get_task",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"otbrl.tasks.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'otbrl.tasks' has no attribute {name!r}")
