"""`python -m studies progress EXPERIMENT`: how far an experiment's runs have got, blind to their results.

Whoever trains a share of a registered experiment should not see its interim numbers: a rule is easier to
bend once the numbers are known. This reads only what a run has spent (steps, generated tokens against the
budget, training seconds, its newest checkpoint, when it last wrote), through a whitelist of metrics.jsonl
keys, so no reward, held-out score or gradient statistic reaches the screen.

    python -m studies progress smollm2c                # runs with a folder here and no record yet
    python -m studies progress smollm2c --seeds 20-21  # every run of those seeds, recorded ones too
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from studies.experiment import load_experiment, plan
from studies.pages import RESULTS
from studies.runs import Run, has_record, is_done

SHOWN = ("step", "generated_tokens", "train_seconds")  # nothing here depends on a reward


def last_logged(metrics: Path) -> dict[str, float]:
    """The `SHOWN` values of the last training step in a run's metrics.jsonl ({} before its first step).
    A torn last line (the run is writing it) is skipped."""
    if not metrics.is_file():
        return {}
    last: dict[str, float] = {}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "generated_tokens" in row:
            last = {k: row[k] for k in SHOWN if isinstance(row.get(k), int | float)}
    return last


def newest_checkpoint(folder: Path) -> int | None:
    steps = [int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps) if steps else None


def run_progress(run: Run, records: Path | None, now: float | None = None) -> dict[str, Any]:
    """One run's state and spending: `state` is "recorded" (its record is committed), "not started" (no
    folder), "finished, not recorded" (its summary is written) or "started"; the rest only for a started run.
    Whether a started run is still in flight this cannot tell; `idle_s` (seconds since it last wrote) can."""
    row: dict[str, Any] = {
        "arm": run.arm,
        "seed": run.seed,
        "budget": run.overrides.get("max_generated_tokens"),
    }
    if has_record(run, records):
        return {**row, "state": "recorded"}
    if not run.dir.is_dir():
        return {**row, "state": "not started"}
    metrics = run.dir / "metrics.jsonl"
    written = max((p.stat().st_mtime for p in (metrics, run.dir) if p.exists()), default=None)
    started = run.dir / "started.json"
    attempt = json.loads(started.read_text()).get("attempt_started") if started.is_file() else None
    return {
        **row,
        "state": "finished, not recorded" if is_done(run) else "started",
        **last_logged(metrics),
        "checkpoint": newest_checkpoint(run.dir),
        "attempt_started": attempt,
        "idle_s": None if written is None else (time.time() if now is None else now) - written,
    }


def progress(
    spec: str, seeds: list[int] | None = None, runs_dir: Path | None = None, results: Path | None = None
) -> tuple[list[dict[str, Any]], int, int]:
    """The rows to show (every run of `seeds`; without seeds, the runs with a folder in `runs_dir` and no
    record), and how many of the experiment's planned runs have a record, of how many."""
    exp = load_experiment(spec)
    runs_dir = runs_dir or Path("runs/compare") / exp.name
    records = (results or RESULTS) / "runs" / exp.name
    runs = plan(exp, runs_dir)
    unknown = sorted(set(seeds or []) - set(exp.seeds))
    if unknown:
        raise ValueError(
            f"{exp.name}: seeds {unknown} are not among its seeds ({exp.seeds[0]}-{exp.seeds[-1]})"
        )
    rows = [run_progress(r, records) for r in runs if (r.seed in seeds if seeds else r.dir.is_dir())]
    if not seeds:
        rows = [r for r in rows if r["state"] != "recorded"]
    recorded = sum(has_record(r, records) for r in runs)
    return rows, recorded, len(runs)


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key == "generated_tokens":
        budget = row.get("budget")
        return f"{value:,.0f}" + (f" of {budget:,} ({100 * value / budget:.0f}%)" if budget else "")
    if key == "train_seconds":
        return f"{value / 60:.0f} min"
    if key == "idle_s":
        return f"{value / 60:.0f} min ago"
    return f"{value:.0f}" if isinstance(value, float) else str(value)


COLUMNS = {
    "arm": "arm",
    "seed": "seed",
    "state": "state",
    "step": "step",
    "generated_tokens": "generated tokens",
    "train_seconds": "training",
    "checkpoint": "checkpoint",
    "attempt_started": "this attempt started",
    "idle_s": "last wrote",
}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned plain-text table (one line a run)."""
    cells = [list(COLUMNS.values())] + [[_cell(r, k) for k in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells
    )
