"""A run's `metrics.jsonl`: one JSON object per logged step. The one reader and writer of that file, shared
by training (which writes it), its callbacks (which resume it) and the studies (which read it), and the
moving average its curves are smoothed with."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def read_metrics(path: Path, key: str | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (blank lines skipped); with `key`, only the rows that hold it."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows if key is None else [r for r in rows if key in r]


def write_metrics(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Replace the file with these rows, one JSON object a line."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """Add one row (one logged step) at the end of the file."""
    with Path(path).open("a") as f:
        f.write(json.dumps(row) + "\n")


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
