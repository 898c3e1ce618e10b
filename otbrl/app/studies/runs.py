"""Training runs on disk: the moving average their curves (`otbrl.app.metrics`) are smoothed with, and
`otbrl train` runs launched in their own
processes, resuming what is already done: a run with a committed record (`records`) is never trained
again, on any machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def moving_average(values: list[float], window: int, centred: bool = True) -> list[float]:
    """Mean over a window at each step, shorter where the series begins or ends. centred: window // 2
    steps on either side (no lag, so a curve crosses a level where the raw series does); otherwise the
    last `window` steps up to and including this one (trailing, as a live curve would)."""
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    before, after = (window // 2, window // 2) if centred else (window - 1, 0)
    out = []
    for i in range(len(values)):
        part = values[max(0, i - before) : i + after + 1]
        out.append(sum(part) / len(part))
    return out


@dataclass
class Run:
    """One `otbrl train` run: an experiment's arm at one seed, its directory and its recipe overrides."""

    arm: str
    seed: int
    dir: Path
    overrides: dict[str, Any]


def is_done(run: Run) -> bool:
    """A run counts as done when it wrote its summary with the same recipe it would be run with now."""
    recipe = run.dir / "run.json"
    return (
        (run.dir / "summary.json").is_file()
        and recipe.is_file()
        and (json.loads(recipe.read_text()) == run.overrides)
    )


def has_record(run: Run, records: Path | None) -> bool:
    """The run's committed record exists and was made with the overrides it would run with now."""
    from otbrl.app.studies.records import comparable, read_record, record_path

    if records is None:
        return False
    path = record_path(records, run.arm, run.seed)
    return path.is_file() and read_record(path)["overrides"] == comparable(run.overrides)


def _train(recipe: str, run: Run) -> tuple[int, str]:
    """Run `otbrl train` for one run in its own process, its output in the run's train.log.
    Returns (exit code, a line that says why it failed, or "")."""
    run.dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "otbrl.app.cli", "train", "--config", recipe]
    for key, value in run.overrides.items():
        args += [f"--{key}", json.dumps(value) if isinstance(value, dict | list | bool) else str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": str(run.overrides["threads"])}
    log_path = run.dir / "train.log"
    with log_path.open("w") as out:
        code = subprocess.call(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code == 0:
        (run.dir / "run.json").write_text(json.dumps(run.overrides))
        return code, ""
    tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
    return code, f"{run.arm} seed {run.seed}: exit {code}: {tail[0]} (log: {log_path})"


def execute(
    name: str, recipe: str, runs: list[Run], jobs: int = 2, log: Callable[[str], Any] = print,
    records: Path | None = None, stamp: dict[str, Any] | None = None,
) -> list[str]:
    """Run what is not done yet of experiment `name` (base recipe `recipe`), `jobs` at a time. With
    `records` (a folder of committed run records), a run with a record is done, a finished run directory
    without one gets one, and each run that finishes writes its record at once, stamped with `stamp` (the
    protocol's hash), so a stop at any point loses at most the runs in flight. Returns one line per failed
    run (nothing is dropped silently)."""
    from otbrl.app.studies.records import make_record, now, record_path, write_record

    def keep(run: Run) -> None:
        if records is not None:
            write_record(record_path(records, run.arm, run.seed), make_record(run, stamp or {}))

    recorded = [r for r in runs if has_record(r, records)]
    for r in runs:
        if r not in recorded and is_done(r) and records is not None:
            keep(r)
            recorded.append(r)
    todo = [r for r in runs if r not in recorded and not is_done(r)]
    if len(todo) < len(runs):
        log(f"{len(runs) - len(todo)} of {len(runs)} runs already done"
            + (f" ({len(recorded)} with a record in {records})" if records is not None else "")
            + " (delete a run's record and directory to redo it)")  # fmt: skip
    failures: list[str] = []
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"{name} runs", unit="run")
    except ImportError:
        bar = None

    def one(run: Run) -> None:
        start = time.perf_counter()
        run.dir.mkdir(parents=True, exist_ok=True)
        started = run.dir / "started.json"  # a resumed run keeps the stamp and time it first started under
        if not started.is_file():
            started.write_text(json.dumps({"protocol": stamp or {}, "started": now()}))
        code, failure = _train(recipe, run)
        if failure:
            failures.append(failure)
        else:
            keep(run)
        if bar is not None:
            bar.set_postfix_str(f"{run.arm} s{run.seed} {time.perf_counter() - start:.0f}s")
            bar.update()
        else:
            log(f"done {run.arm} seed {run.seed} ({time.perf_counter() - start:.0f}s, exit {code})")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, todo))
    if bar is not None:
        bar.close()
    return failures
