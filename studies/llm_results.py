"""Publish a finished real-model run (`otbrl train --config smollm2-...`) under docs/results/: its summary,
curves (reward with held-out points, completion length and within-group length CV, gradient norm) and its
per-step metrics, compressed, so the page can be checked against the data.

    .venv/bin/python -m studies.llm_results runs/smollm2-sums llm-sums "make demo-llm"
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import sys
from pathlib import Path

from otbrl.app.metrics import read_metrics
from otbrl.app.plots import plot_curves
from studies.pages import RESULTS, machine


def horizon(rows: list[dict]) -> str:
    """Within-group length CV over the whole run (every step that logged it), and its first/last thirds."""
    cv = [r["otb/horizon/length_cv"] for r in rows if r.get("otb/horizon/length_cv") is not None]
    if not cv:
        return "not logged"
    third = max(1, len(cv) // 3)
    first, last = statistics.mean(cv[:third]), statistics.mean(cv[-third:])
    whole = statistics.mean(cv)
    return f"mean {whole:.2f} over {len(cv)} steps (first third {first:.2f}, last third {last:.2f})"


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit("usage: llm_results.py RUN_DIR NAME COMMAND")
    run, name, command = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    summary = json.loads((run / "summary.json").read_text())
    recipe = (run / "recipe.yaml").read_text()
    rows = read_metrics(run / "metrics.jsonl")
    with gzip.open(RESULTS / f"{name}.metrics.jsonl.gz", "wt") as f:
        f.write((run / "metrics.jsonl").read_text())
    title = f"{summary['estimator']}, N={summary['group size N']}: {name}"
    plot_curves(run / "metrics.jsonl", RESULTS / f"{name}.png", title, summary["held-out reward before"])
    held = [(r["generated_tokens"], r["heldout_reward"]) for r in rows if r.get("heldout_reward") is not None]
    lengths = [r["completions/mean_length"] for r in rows if "completions/mean_length" in r]
    gain = summary["held-out reward after"] - summary["held-out reward before"]
    lines = [
        f"# Real model: {name}",
        "",
        machine(1),
        "",
        f"Command: `{command}` (recipe below). Per-step metrics: [{name}.metrics.jsonl.gz]"
        f"({name}.metrics.jsonl.gz); this page: `python -m studies.llm_results RUN_DIR {name} "
        f"'{command}'`.",
        "",
        (run / "summary.md").read_text().strip(),
        "",
        f"- held-out reward gain: {gain:+.3f} in {summary['train seconds'] / 60:.1f} min of training",
        "- held-out at token budgets: "
        + (", ".join(f"{r:.3f} @ {t:.0f}" for t, r in held) if held else "none (before and after only)"),
        f"- mean completion length: first step {lengths[0]:.1f}, last {lengths[-1]:.1f} tokens",
        f"- within-group length CV: {horizon(rows)}",
        "",
        f"![curves]({name}.png)",
        "",
        "Recipe as run:",
        "",
        "```yaml",
        recipe.strip(),
        "```",
        "",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines))
    shutil.copy(run / "summary.json", RESULTS / f"{name}.summary.json")
    print(f"wrote {RESULTS / name}.md, .png, .summary.json, .metrics.jsonl.gz")


if __name__ == "__main__":
    main()
