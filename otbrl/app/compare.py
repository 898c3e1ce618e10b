"""`otbrl compare`: your own recipe trained under several advantage estimators ("arms") and seeds, then a
table of held-out reward per arm with paired 95% t intervals against the first arm, and a plot.

Every run is a plain `otbrl train` run in `<out>/<arm>/seed<k>/`; a run whose summary.json exists is read,
not trained again, so an interrupted comparison resumes where it stopped. Runs of one seed share the seed,
so they draw the same prompts and start from the same held-out score: the differences are paired by seed.
(The project's own registered experiments, with protocols and verdict rules, live in the repository's
evidence suite, not here.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otbrl.app.intervals import mean_interval
from otbrl.app.metrics import moving_average, read_metrics
from otbrl.app.plots import STYLES, band, pyplot, save
from otbrl.app.recipe import load_recipe
from otbrl.app.train import run

AFTER, BEFORE = "held-out reward after", "held-out reward before"


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed{seed}"


def train_arms(
    config: str,
    arms: list[str],
    seeds: list[int],
    out: Path,
    overrides: dict[str, Any],
    log: Callable[[str], Any] = print,
) -> dict[str, dict[int, dict[str, Any]]]:
    """Train (or read back) every arm x seed; {arm: {seed: summary}}. Every recipe is checked before
    the first run trains, so a bad override fails at once, not after hours."""
    if len(set(arms)) != len(arms) or len(arms) < 2:
        raise ValueError(f"arms: need at least two distinct estimators, got {arms}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: need distinct seeds, got {seeds}")
    recipes = {
        (arm, seed): load_recipe(
            config,
            {
                **overrides,
                "advantage_estimator": arm,
                "seed": seed,
                "output_dir": str(run_dir(out, arm, seed)),
            },
        )
        for seed in seeds
        for arm in arms
    }
    summaries: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in arms}
    for i, ((arm, seed), recipe) in enumerate(recipes.items(), 1):
        done = run_dir(out, arm, seed) / "summary.json"
        if done.is_file():
            log(f"[{i}/{len(recipes)}] {arm}, seed {seed}: done before, read from {done}")
            summaries[arm][seed] = json.loads(done.read_text())
            continue
        log(f"[{i}/{len(recipes)}] {arm}, seed {seed}: training")
        summaries[arm][seed] = run(recipe, log=log)
    return summaries


def comparison_table(summaries: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Held-out reward before and after per arm (mean over seeds), and each arm's paired difference
    from the first arm, seed by seed, with its 95% t interval."""
    arms = list(summaries)
    first = arms[0]
    lines = [
        f"| arm | seeds | {BEFORE} | {AFTER} | generated tokens | {AFTER}: arm − {first} [95% CI] |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for arm in arms:
        runs = summaries[arm]
        befores = [s[BEFORE] for s in runs.values() if s.get(BEFORE) is not None]
        afters = [s[AFTER] for s in runs.values()]
        tokens = [s["generated tokens"] for s in runs.values()]
        if arm == first:
            diff = "—"
        else:
            paired = sorted(set(runs) & set(summaries[first]))
            diff = str(mean_interval([runs[k][AFTER] - summaries[first][k][AFTER] for k in paired]))
        before = f"{sum(befores) / len(befores):.3f}" if befores else "—"
        lines.append(
            f"| {arm} | {len(runs)} | {before} | {sum(afters) / len(afters):.3f} | "
            f"{sum(tokens) / len(tokens):.0f} | {diff} |"
        )
    return "\n".join(lines)


def plot_comparison(out: Path, summaries: dict[str, dict[int, dict[str, Any]]], png: Path) -> None:
    """Train reward (trailing mean of 10 steps) against generated tokens, mean over seeds with a 95% t
    band per arm; and each arm's held-out reward before and after training (mean, 95% t interval)."""
    plt = pyplot()
    fig, (curve_ax, heldout_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, runs) in enumerate(summaries.items()):
        style = {"color": colours[i % len(colours)], "ls": STYLES[i % len(STYLES)]}
        xs, ys = [], []
        for seed in runs:
            rows = read_metrics(run_dir(out, arm, seed) / "metrics.jsonl", "reward")
            if len(rows) > 1:
                xs.append([r["generated_tokens"] for r in rows])
                ys.append(moving_average([r["reward"] for r in rows], 10, centred=False))
        if xs:
            grid, mean, half = band(xs, ys)
            curve_ax.plot(grid, mean, label=f"{arm} (n={len(xs)})", lw=1.6, **style)
            curve_ax.fill_between(grid, mean - half, mean + half, color=style["color"], alpha=0.15, lw=0)
        for x, key in ((0, BEFORE), (1, AFTER)):
            vals = [s[key] for s in runs.values() if s.get(key) is not None]
            if vals:
                iv = mean_interval(vals)
                heldout_ax.errorbar(
                    x + 0.06 * i,
                    iv.mean,
                    yerr=iv.hi - iv.mean,
                    capsize=3,
                    marker="o",
                    label=arm if x == 1 else None,
                    **style,
                )
    curve_ax.set(xlabel="generated tokens", ylabel="train reward (trailing mean of 10 steps)")
    heldout_ax.set(xticks=[0, 1], xticklabels=["before training", "after"], ylabel="held-out reward (95% CI)")
    for ax in (curve_ax, heldout_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("arms compared over seeds (bands and bars: 95% t intervals)", fontsize=10)
    save(fig, png, dpi=100)


def compare(
    config: str,
    arms: list[str],
    seeds: list[int],
    out: Path,
    overrides: dict[str, Any],
    plot: bool = True,
    log: Callable[[str], Any] = print,
) -> Path:
    """Train the arms, then write `<out>/compare.md` (and compare.png). Returns the page's path."""
    summaries = train_arms(config, arms, seeds, out, overrides, log)
    page = out / "compare.md"
    text = (
        f"# {', '.join(arms)} on `{config}`, seeds {', '.join(map(str, seeds))}\n\n"
        f"{comparison_table(summaries)}\n\nDifferences are paired by seed (same prompts, same start); "
        "an interval that excludes 0 says the arms differ at that seed count. Runs: "
        f"`{out}/<arm>/seed<k>/`.\n"
    )
    page.write_text(text)
    if plot:
        plot_comparison(out, summaries, out / "compare.png")
    return page
