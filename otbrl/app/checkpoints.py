"""Finding the checkpoint a run resumes from: the newest complete `checkpoint-<step>` in its output
directory (a process killed while saving leaves a torn one behind, which is skipped)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
    for path in sorted(found, key=checkpoint_step, reverse=True):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        log(f"{path.name} is incomplete ({', '.join(problems)}): skipped")
    return None


def checkpoint_step(path: Path) -> int:
    """The step a `checkpoint-<step>` directory was saved at."""
    return int(path.name.rpartition("-")[2])
