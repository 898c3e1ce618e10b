"""Where an experiment's phenomenon stands, from its committed records alone: each run's value of the
protocol's `phenomenon` keys (e.g. the within-group length CV averaged over the run's steps) at every
arm's learning rate, per stage (the pilot's first stage and variance seeds at that rate, the reported
runs so far), and per comparison the level its reported runs head for. It shows no held-out or train
reward, so it can be looked at while the reported runs are still going.

    python -m studies phenomenon smollm2c     # -> docs/results/smollm2c-phenomenon.md and .png
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from studies.experiment import Experiment, load_experiment, pilot_plan, plan, variance_plan
from studies.inference import scipy_stats, t_interval
from studies.outcomes import analyse_rows
from studies.pages import markdown_table
from studies.pilot import run_data
from studies.runs import Run

RUNS = Path("runs/compare")


def stages(exp: Experiment) -> dict[str, list[Run]]:
    """The runs at each arm's learning rate (the YAML's, where the pilot's picks were written), by stage:
    the pilot's first stage, its variance seeds, and the reported runs (named by arm, as records are)."""
    rates = {arm: (exp.arms[arm] or {}).get("learning_rate") for arm in exp.arms}
    out: dict[str, list[Run]] = {}
    if exp.pilot:
        first = pilot_plan(exp, RUNS / exp.name / "pilot")
        out["pilot, first stage"] = [
            r for r in first if rates.get(r.arm.rpartition("@")[0]) == r.overrides.get("learning_rate")
        ]
        if exp.pilot.get("variance_seeds") and all(rates[a] is not None for a in exp.arms):
            out["pilot, variance seeds"] = variance_plan(exp, RUNS / exp.name / "pilot", rates)
    out["reported runs"] = plan(exp, RUNS / exp.name)
    return out


def run_values(exp: Experiment, results: Path) -> list[dict[str, Any]]:
    """One row per finished run: stage, arm, seed and its value of each phenomenon key, read from the
    committed records (`results/runs/NAME[-pilot]/`) by the rule that reads the reported runs."""
    rows = []
    for stage, runs in stages(exp).items():
        records = results / "runs" / (exp.name if stage == "reported runs" else f"{exp.name}-pilot")
        for run in runs:
            data = run_data(run, records)
            if data is None:
                continue
            result = analyse_rows(*data, exp)
            arm = run.arm.rpartition("@")[0] or run.arm
            rows.append(
                {"stage": stage, "arm": arm, "seed": run.seed, **{k: result[k] for k in exp.phenomenon}}
            )
    return rows


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) < 2:
        return f"{values[0]:.3f} (n=1)"
    iv = t_interval(values)
    return f"{iv.mean:.3f} [{iv.lo:.3f}, {iv.hi:.3f}] (SD {statistics.stdev(values):.3f}, n={iv.n})"


def heading_for(
    values: dict[str, list[float]], floor: float, planned: int, confidence: float = 0.95
) -> dict[str, Any]:
    """The level a comparison's reported runs head for when every arm ends with `planned` runs (paired
    seed by seed): the mean of the arms' means, with a normal interval from their standard errors; where
    that interval lies against `floor`; and the chance that the finished plan reads at least `floor`:
    normal, with the spread of today's estimate (flat prior) plus that of a `planned`-run mean."""
    if not values or any(len(v) < 2 for v in values.values()):
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "reads": "too few runs", "chance": math.nan}
    k = len(values)
    mean = statistics.fmean(statistics.fmean(v) for v in values.values())
    se = math.sqrt(sum(statistics.variance(v) / len(v) for v in values.values())) / k
    se_plan = math.sqrt(sum(statistics.variance(v) / planned for v in values.values())) / k
    norm = scipy_stats().norm
    z = norm.ppf(0.5 + confidence / 2)
    lo, hi = mean - z * se, mean + z * se
    reads = (
        "below the floor" if hi < floor else "above the floor" if lo >= floor else "either side of the floor"
    )
    chance = float(norm.sf((floor - mean) / math.hypot(se, se_plan))) if se > 0 else float(mean >= floor)
    return {"mean": mean, "lo": lo, "hi": hi, "reads": reads, "chance": chance}


def phenomenon_page(exp: Experiment, results: Path) -> str:
    rows = run_values(exp, results)
    parts = [
        f"# Experiment `{exp.name}`: its phenomenon, run by run\n",
        f"Regenerate: `python -m studies phenomenon {exp.name}` (from the committed records alone; it trains "
        "nothing and shows no reward).\n",
        "The claims need "
        + ", ".join(f"{k} ≥ {float(v):g}" for k, v in exp.phenomenon.items())
        + " over each comparison's two arms' runs (each run's mean over its steps, averaged over the runs "
        "of both arms; `studies.outcomes.phenomenon_missing`), else they read **not tested**. Here is that "
        "quantity for every committed run at each arm's learning rate (the YAML's, the pilot's pick): the "
        "pilot's first stage, its variance seeds, and the reported runs so far. The pilot's runs ran the "
        "reported runs' setting on other seeds, so they say where the reported runs are heading.\n",
    ]
    stage_names = list(dict.fromkeys(r["stage"] for r in rows))
    for key, floor in exp.phenomenon.items():
        table = []
        for arm in exp.arms:
            mine = [r for r in rows if r["arm"] == arm and math.isfinite(r[key])]
            by_stage = [_cell([r[key] for r in mine if r["stage"] == s]) for s in stage_names]
            table.append([arm, *by_stage, _cell([r[key] for r in mine])])
        parts.append(
            f"`{key}` of each arm: mean [95% t interval of the mean] (SD between runs, runs):\n\n"
            + markdown_table(["arm", *stage_names, "every run"], table, aligned=False)
            + "\n"
        )
        lines = []
        for c in exp.comparisons:
            arms = (c["candidate"], c["baseline"])
            values = {a: [r[key] for r in rows if r["arm"] == a and math.isfinite(r[key])] for a in arms}
            h = heading_for(values, float(floor), len(exp.seeds), exp.confidence)
            lines.append(
                [
                    c["name"],
                    " + ".join(f"{a} ({len(v)} runs)" for a, v in values.items()),
                    f"{h['mean']:.3f} [{h['lo']:.3f}, {h['hi']:.3f}]",
                    f"{float(floor):g}",
                    f"**{h['reads']}**",
                    f"{h['chance']:.0%}" if math.isfinite(h["chance"]) else "—",
                ]
            )
        parts.append(
            f"Where each comparison's reported runs head for (every run at the picks, every stage): the mean "
            f"of its two arms' means with a {exp.confidence:.0%} normal interval from their standard errors, "
            "which is what the reported runs read once both arms have the same number of runs and the runs "
            f"to come are like these; and the chance that the plan's {len(exp.seeds)} seeds end at or above "
            "the floor (normal: today's estimate, flat prior, plus the spread of a mean over the planned "
            "runs):\n\n"
            + markdown_table(
                ["comparison", "runs", f"{key}, heading for", "floor", "reads", "chance it ends ≥ floor"],
                lines,
                aligned=False,
            )
            + "\n"
        )
    return "\n".join(parts)


def plot_phenomenon(exp: Experiment, rows: list[dict[str, Any]], png: Path) -> None:
    """Each run's value of the first phenomenon key, one column per arm, one marker per stage; the floor
    dashed."""
    from otbrl.app.plots import MARKERS, pyplot, save

    plt = pyplot()
    key, floor = next(iter(exp.phenomenon.items()))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(exp.arms), 4))
    stage_names = list(dict.fromkeys(r["stage"] for r in rows))
    for i, arm in enumerate(exp.arms):
        for j, stage in enumerate(stage_names):
            ys = [r[key] for r in rows if r["arm"] == arm and r["stage"] == stage and math.isfinite(r[key])]
            xs = [i + (j - (len(stage_names) - 1) / 2) * 0.2] * len(ys)
            ax.scatter(
                xs, ys, marker=MARKERS[j % len(MARKERS)], color=f"C{j}", label=stage if i == 0 else None
            )
        every = [r[key] for r in rows if r["arm"] == arm and math.isfinite(r[key])]
        if len(every) >= 2:
            iv = t_interval(every)
            ax.errorbar(
                [i + 0.42],
                [iv.mean],
                yerr=[[iv.mean - iv.lo], [iv.hi - iv.mean]],
                color="k",
                fmt="o",
                capsize=4,
            )
    ax.axhline(float(floor), color="grey", ls="--", label=f"floor {float(floor):g}")
    ax.set_xticks(range(len(exp.arms)), list(exp.arms))
    ax.set_ylabel(f"{key} (each run: mean over its steps)")
    ax.set_title(
        f"{exp.name}: {key} of every run at the picks\n(black: mean of every run, 95% t interval)",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, png, dpi=100)


def phenomenon(name: str, results: Path = Path("docs/results")) -> Path:
    """Write `results/NAME-phenomenon.md` and its plot; returns the page's path."""
    exp = load_experiment(name)
    if not exp.phenomenon:
        raise ValueError(f"experiment {name}: no `phenomenon` floors to read")
    page = results / f"{exp.name}-phenomenon.md"
    png = page.with_suffix(".png")
    text = phenomenon_page(exp, results)
    rows = run_values(exp, results)
    if rows:
        plot_phenomenon(exp, rows, png)
        text += f"\n![{exp.phenomenon and next(iter(exp.phenomenon))} of every run]({png.name})\n"
    page.write_text(text)
    return page
